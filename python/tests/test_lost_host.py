"""A lost host, not only a lost process: three "hosts" are network
namespaces on a bridge, the job's store a fourth; one host's link is cut
mid-training (its sockets stay open, nothing is closed). The survivors'
liveness monitors must find it within 2 s (gloo alone would wait out its
timeout) and go on exactly, as after a kill. The cut-off host is the
minority of a partition: it cannot reach the store, so it cannot commit a
membership of its own; when its link comes back it finds the job went on
without it and leaves.

Needs root (``ip netns``); skipped with the reason otherwise.
"""

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from test_elastic import DEADLINE_S, EXAMPLE, free_port, rank0, reports

NAMESPACES = ["gs-store", "gs-h0", "gs-h1", "gs-h2"]
STORE_IP = "10.77.0.1"


def ip(*args, check=True):
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def teardown():
    for ns in NAMESPACES:
        pids = ip("netns", "pids", ns, check=False).stdout.split()
        for pid in pids:
            subprocess.run(["kill", "-9", pid], capture_output=True)
        ip("netns", "del", ns, check=False)


@pytest.fixture
def hosts():
    """The store's namespace with a bridge, and three host namespaces, each
    linked to the bridge by a veth pair (its end in the store's namespace
    named ``vh<k>``, the one to cut)."""
    teardown()
    try:
        for ns in NAMESPACES:
            ip("netns", "add", ns)
        ip("-n", "gs-store", "link", "add", "br0", "type", "bridge")
        ip("-n", "gs-store", "addr", "add", f"{STORE_IP}/24", "dev", "br0")
        for dev in ("br0", "lo"):
            ip("-n", "gs-store", "link", "set", dev, "up")
        for k in range(3):
            ip("-n", "gs-store", "link", "add", f"vh{k}", "type", "veth", "peer", "name", "eth0", "netns", f"gs-h{k}")
            ip("-n", "gs-store", "link", "set", f"vh{k}", "master", "br0", "up")
            ip("-n", f"gs-h{k}", "addr", "add", f"10.77.0.{10 + k}/24", "dev", "eth0")
            for dev in ("eth0", "lo"):
                ip("-n", f"gs-h{k}", "link", "set", dev, "up")
    except (FileNotFoundError, subprocess.CalledProcessError) as e:
        teardown()
        pytest.skip(f"network namespaces unavailable here (needs root and iproute2): {getattr(e, 'stderr', e)}")
    yield
    teardown()


def in_ns(ns, *cmd, **kw):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "eth0"}
    return subprocess.Popen(["ip", "netns", "exec", ns, *cmd], env=env, text=True, **kw)


def test_a_host_whose_link_is_cut_is_found_within_two_seconds(hosts, tmp_path):
    port = free_port()
    store = in_ns("gs-store", sys.executable, "-m", "gradsync.launch", "--store-only", "--host", STORE_IP,
                  "--port", str(port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp_path)
    time.sleep(2.0)  # the store is up before the workers' first connect gives up
    launchers = []
    for k in range(3):
        launchers.append(in_ns(
            f"gs-h{k}", sys.executable, "-m", "gradsync.launch", "--store", f"{STORE_IP}:{port}", "--nnodes", "3",
            "--node-rank", str(k), "--nproc", "1", str(EXAMPLE), "--steps", "400", "--log-every", "10",
            "--report", str(tmp_path / "out"),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path,
        ))
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(launchers[0].stdout), daemon=True)
    reader.start()
    try:
        began = time.time()
        while not any(line.startswith("step   31/") for line in lines):
            assert time.time() - began < DEADLINE_S, "training never reached step 31:\n" + "".join(lines)
            assert launchers[0].poll() is None, launchers[0].stderr.read()
            time.sleep(0.02)
        ip("-n", "gs-store", "link", "set", "vh1", "down")
        cut = time.time()
        for k in (0, 2):
            launchers[k].wait(timeout=DEADLINE_S)
        found = reports(tmp_path)
        errors = launchers[0].stderr.read()
        # The partition heals: the minority learns it was left out, and leaves.
        ip("-n", "gs-store", "link", "set", "vh1", "up")
        launchers[1].wait(timeout=DEADLINE_S)
        minority = launchers[1].stderr.read()
    finally:
        store.kill()
        for proc in launchers:
            if proc.poll() is None:
                proc.kill()
    assert launchers[0].returncode == 0 and launchers[2].returncode == 0, errors[-3000:]
    assert sorted(found) == [0, 2], errors[-3000:]
    assert launchers[1].returncode == 3, "its supervisor says its member left the job:\n" + minority[-3000:]
    assert "member 1: left the job" in minority and "was left out of epoch" in minority, minority[-3000:]
    first = rank0(found)
    assert first["ok"] and first["identical"], errors[-3000:]
    (event,) = first["events"]
    assert event["lost"] == [1]
    detected = event["time"] - cut
    assert detected < 2.0, f"the survivors went on {detected:.2f} s after the cut"
    # A record of the measurement, for the closing numbers.
    (tmp_path / "detected.json").write_text(json.dumps({"detected_s": detected}))
    print(f"lost host: survivors in a new group {detected:.2f} s after the cut")
