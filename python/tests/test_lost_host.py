"""A lost host, not only a lost process: three "hosts" are network
namespaces on a bridge, the job's store a fourth, each host with its own
supervisor (the README's several-machines recipe).

* A host whose link is cut mid-training (its sockets stay open, nothing is
  closed): the survivors' liveness monitors find it within 2 s (gloo alone
  would wait out its timeout) and go on exactly, as after a kill. The
  cut-off host cannot reach the store, so it cannot commit a membership of
  its own; when its link comes back it finds the job went on without it
  and leaves.
* A host killed with its supervisor (nobody records its deaths): the
  others go on whatever fraction they are (two hosts of two: half the
  members), equal to a replay; a sharded job loses no partition (each
  one's buddy copy is on another host), and a replacement host started
  with ``--join`` is admitted and receives its partitions.

Needs root (``ip netns``); skipped with the reason otherwise.
"""

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import without_exit_noise
from test_elastic import DEADLINE_S, EXAMPLE, busy_loops, free_port, rank0, reports

NAMESPACES = ["gs-store", "gs-h0", "gs-h1", "gs-h2"]
#: What each test measured, by case: the table docs/elastic.md shows (written as the tests pass).
TABLE = Path(__file__).resolve().parents[2] / "target" / "pytest" / "lost-host.md"
MEASURED = {}


def record(case, seconds, what):
    """Add ``case``'s measurement (``seconds`` of ``what``) to the table the docs show."""
    MEASURED[case] = (seconds, what)
    TABLE.parent.mkdir(parents=True, exist_ok=True)
    rows = [f"| {c} | {s:.2f} s | {w} |" for c, (s, w) in sorted(MEASURED.items())]
    TABLE.write_text("| what was lost (hosts of 2 ranks unless said) | time | from, to |\n|---|---|---|\n"
                     + "\n".join(rows) + "\n")
STORE_IP = "10.77.0.1"
#: The store on a second network (a management network): every host reaches it over ``eth1``, whatever
#: happens to the first (``eth0``, where gloo's collectives and the probes go).
MANAGEMENT_IP = "10.78.0.1"


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
    """The store's namespace with two bridges, and three host namespaces,
    each linked to both: to ``br0`` by ``eth0`` (its end in the store's
    namespace named ``vh<k>``, the one to cut), to ``br1`` (the management
    network) by ``eth1`` (``vm<k>``)."""
    teardown()
    try:
        for ns in NAMESPACES:
            ip("netns", "add", ns)
        for bridge, address in (("br0", STORE_IP), ("br1", MANAGEMENT_IP)):
            ip("-n", "gs-store", "link", "add", bridge, "type", "bridge")
            ip("-n", "gs-store", "addr", "add", f"{address}/24", "dev", bridge)
            ip("-n", "gs-store", "link", "set", bridge, "up")
        ip("-n", "gs-store", "link", "set", "lo", "up")
        for k in range(3):
            for end, dev, bridge, net in (("vh", "eth0", "br0", "10.77.0"), ("vm", "eth1", "br1", "10.78.0")):
                ip("-n", "gs-store", "link", "add", f"{end}{k}", "type", "veth", "peer", "name", dev, "netns",
                   f"gs-h{k}")
                ip("-n", "gs-store", "link", "set", f"{end}{k}", "master", bridge, "up")
                ip("-n", f"gs-h{k}", "addr", "add", f"{net}.{10 + k}/24", "dev", dev)
                ip("-n", f"gs-h{k}", "link", "set", dev, "up")
            ip("-n", f"gs-h{k}", "link", "set", "lo", "up")
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
    record("a host's link cut (3 hosts of 1 rank)", detected, "the cut, to the survivors' new group")
    print(f"lost host: survivors in a new group {detected:.2f} s after the cut")


class Job:
    """A job of ``hosts`` supervisors (``nproc`` workers each) on the host
    namespaces, its store in ``gs-store``; the training script's arguments
    follow. Launcher ``k``'s stdout is read into ``lines[k]``."""

    def __init__(self, tmp_path, hosts, nproc, *script_args, store_ip=STORE_IP):
        self.tmp_path, self.port, self.store_ip = tmp_path, free_port(), store_ip
        self.store = in_ns("gs-store", sys.executable, "-m", "gradsync.launch", "--store-only", "--host", store_ip,
                           "--port", str(self.port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           cwd=tmp_path)
        time.sleep(2.0)  # the store is up before the workers' first connect gives up
        self.args = ("--nproc", str(nproc), str(EXAMPLE), "--report", str(tmp_path / "out"), *script_args)
        self.launchers, self.lines = [], []
        for k in range(hosts):
            self.start(k, "--nnodes", str(hosts), "--node-rank", str(k))

    def start(self, k, *options):
        """A supervisor on host ``k`` with ``options`` (its index in ``launchers``: returned)."""
        proc = in_ns(f"gs-h{k}", sys.executable, "-m", "gradsync.launch", "--store", f"{self.store_ip}:{self.port}",
                     *options, *self.args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=self.tmp_path)
        lines = []
        threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
        self.launchers.append(proc)
        self.lines.append(lines)
        return len(self.launchers) - 1

    def wait_for_step(self, step, launcher=0):
        began = time.time()
        while not any(line.startswith(f"step {step:>4}/") for line in self.lines[launcher]):
            assert time.time() - began < DEADLINE_S, f"training never reached step {step}:\n" + "".join(
                self.lines[launcher])
            assert self.launchers[launcher].poll() is None, self.launchers[launcher].stderr.read()
            time.sleep(0.02)

    def close(self):
        self.store.kill()
        for proc in self.launchers:
            if proc.poll() is None:
                proc.kill()


def kill_host(k):
    """SIGKILL every process of host ``k``: its supervisor, its warm
    interpreter and its workers (nobody is left to record a death)."""
    for pid in ip("netns", "pids", f"gs-h{k}", check=False).stdout.split():
        subprocess.run(["kill", "-9", pid], capture_output=True)


def first_step_after(found, when):
    """Seconds from ``when`` to the first step applied after it, over the survivors."""
    return min(t for r in found.values() for t in r["applied_at"].values() if t > when) - when


@pytest.mark.parametrize("machines,sharded,load", [
    (2, False, 0),
    (3, True, 0),
    pytest.param(2, True, 2, marks=pytest.mark.slow),
    pytest.param(3, False, 2, marks=pytest.mark.slow),
    pytest.param(3, "parameters", 0, marks=pytest.mark.slow),
], ids=["two-hosts", "three-hosts-sharded", "two-hosts-sharded-loaded", "three-hosts-loaded",
        "three-hosts-parameters-sharded"])
def test_a_host_killed_with_its_supervisor_is_survived(hosts, tmp_path, machines, sharded, load):
    """Host 1 (members 2 and 3) is killed mid-training with its supervisor:
    the members on the other hosts go on (two hosts: half the job), equal
    to a replay; sharded, nothing of the optimizer is lost (each partition's
    buddy copy is on another host), and a replacement host started with
    ``--join`` is admitted and receives its partitions and the model
    (``"parameters"``: the parameters sharded too, their pieces with a
    buddy copy on another host, and the replacement receives its pieces)."""
    # (SGD with momentum: over hundreds of steps AdamW amplifies the rounding
    # differences between six ranks' sum order and the replay's past the tolerance.)
    extra = {True: ("--shard",), "parameters": ("--shard-params",)}.get(sharded, ())
    replace = sharded and not load
    steps = "240" if replace else "200"
    spinning = busy_loops(load)
    job = Job(tmp_path, machines, 2, "--steps", steps, "--log-every", "10", "--pace-ms", "25", *extra)
    try:
        job.wait_for_step(31)
        kill_host(1)
        killed = time.time()
        running = [k for k in range(machines) if k != 1]
        if replace:
            time.sleep(0.5)
            running.append(job.start(1, "--join", "--node-rank", "1"))
        for k in running:
            job.launchers[k].wait(timeout=DEADLINE_S)
        errors = "".join(without_exit_noise(job.launchers[k].stderr.read()) for k in running)
        errors += "".join(job.lines[0][-8:])
    finally:
        job.close()
        for p in spinning:
            p.kill()
    assert all(job.launchers[k].returncode == 0 for k in running), errors[-4000:]
    found = reports(tmp_path)
    survivors = sorted(m for m in range(2 * machines) if m not in (2, 3))
    joiners = [2 * machines, 2 * machines + 1] if replace else []
    assert sorted(found) == survivors + joiners, errors[-4000:]
    first = rank0(found)
    assert first["ok"] and first["identical"] and not first["norms_off"], errors[-4000:]
    assert len({r["digest"] for r in found.values()}) == 1
    assert all(r["history"] == first["history"] for r in found.values()), "one history, the joiners' too"
    assert sorted(m for e in first["events"] if e["kind"] == "lost" for m in e["lost"]) == [2, 3]
    worlds = [w for _, w, *_ in first["history"]]
    assert worlds[0] == 2 * machines and 2 * machines - 2 in worlds
    if replace:
        assert worlds[-1] == 2 * machines, "the replacement host's members train to the end"
    after = first_step_after(found, killed)
    record(f"1 of {machines} hosts killed with its supervisor"
           + {True: ", sharded", "parameters": ", parameters sharded"}.get(sharded, "")
           + (", then a replacement host joins" if replace else "") + (f", {load} busy loops" if load else ""),
           after, "the kill, to the survivors' next applied step")
    print(f"lost host ({machines} hosts, sharded {sharded}, {load} busy loops): "
          f"next step applied {after:.2f} s after the kill")


def test_a_partition_whose_sides_both_reach_the_store_goes_on_on_one_side(hosts, tmp_path):
    """Three hosts of one rank; host 2's data link (``eth0``: gloo and the
    probes) is cut while every host still reaches the store over the
    management network, so every heartbeat keeps moving. The step waits
    out its collective deadline; then every member checks in, each naming
    the peers its probes could not reach: one roster commits, the larger
    side {0, 1} goes on exactly, and host 2, which reached the store all
    along, finds a roster without it and leaves. Never both sides."""
    job = Job(tmp_path, 3, 1, "--steps", "120", "--log-every", "10", "--timeout", "4", store_ip=MANAGEMENT_IP)
    try:
        job.wait_for_step(31)
        ip("-n", "gs-store", "link", "set", "vh2", "down")
        cut = time.time()
        for k in range(3):
            job.launchers[k].wait(timeout=DEADLINE_S)
        errors = without_exit_noise(job.launchers[0].stderr.read()) + "".join(job.lines[0][-8:])
        minority = without_exit_noise(job.launchers[2].stderr.read())
    finally:
        job.close()
    assert job.launchers[0].returncode == 0 and job.launchers[1].returncode == 0, errors[-3000:]
    assert job.launchers[2].returncode == 3, "host 2's supervisor says its member left the job:\n" + minority[-3000:]
    assert "was left out of epoch" in minority, minority[-3000:]
    found = reports(tmp_path)
    assert sorted(found) == [0, 1], errors[-3000:]
    first = rank0(found)
    assert first["ok"] and first["identical"], errors[-3000:]
    assert [e["lost"] for e in first["events"] if e["lost"]] == [[2]]
    record("a partition whose sides both reach the store (3 hosts of 1 rank)", first_step_after(found, cut),
           "the cut, to the larger side's next applied step (the step's collective deadline, 4 s here, first)")
