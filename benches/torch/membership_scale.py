"""The membership protocol at a job's size, on real stores: N real members
(``gradsync._native.Membership`` objects, as ``Elastic`` builds them, many
per process: ``gradsync._members``) against one TCPStore hosted as
``python -m gradsync.launch --store-only`` hosts it, or one etcd server.

    python benches/torch/membership_scale.py [--stores tcp etcd] [--members 8 32 128 512] [--json PATH] [--isolate]
        [--capacity]

For each store and size: all members start; healthy for a few seconds
(the beat period is read off the store: a sample of members' heartbeat
counts, read twice); then one member goes silent (its monitor stops: a
host whose link is cut), then one is killed (its process SIGKILLed, nobody
records the death). For each loss it reports the first detection (the first
member that saw the epoch broken, from the loss), the agreement (from that
detection to the last survivor holding the new roster), and the healthy
members left out (any survivor missing from the roster, or failing).
Timestamps are the members' own ``time.time()`` on this machine.
``--capacity`` also measures how many beats a second each store answers at
most (64 members beating every millisecond): what the docs' extrapolation
to larger jobs divides by.

``--isolate`` runs everything in a private network namespace (root only;
``unshare -n``): c10d resolves the peer of every connection it makes, and
a resolver that drops lookups (this sandbox's does, now and then) costs 5 s
per connection; in a namespace with only loopback the lookup fails at once.
etcd: ``GRADSYNC_ETCD`` or ``etcd`` on the PATH (``scripts/debian-binary.sh
etcd-server etcd`` unpacks Debian's).
"""

import argparse
import datetime
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIVENESS_S = 1.0
#: The beat every scenario runs (``Timing``'s default).
BEAT_S = 0.1


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Members:
    """``python -m gradsync._members`` running ``first`` members against
    ``address`` (``victim`` alone in one process); its events are collected as they come."""

    def __init__(self, address, job, first, procs, victim, liveness_s=LIVENESS_S, beat_s=BEAT_S):
        self.events, self.errors = [], []
        self._lock = threading.Lock()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gradsync._members", "--store", address, "--job", job, "--first", str(first),
             "--procs", str(procs), "--victim", str(victim), "--liveness", str(liveness_s), "--beat", str(beat_s)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"})
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._read_errors, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            with self._lock:
                self.events.append(json.loads(line))

    def _read_errors(self):
        for line in self.proc.stderr:
            text = line.decode(errors="replace")
            if "hostname of the client socket cannot be retrieved" not in text:  # (no resolver in --isolate)
                self.errors.append(text)

    def of(self, event, epoch=None):
        with self._lock:
            return [e for e in self.events if e["event"] == event and (epoch is None or e.get("epoch") == epoch)]

    def wait_for(self, event, count, epoch=None, within_s=120.0):
        """The ``event`` events of ``epoch`` once ``count`` came (``None``
        after ``within_s``, or once a member failed)."""
        deadline = time.monotonic() + within_s
        while len(self.of(event, epoch)) < count:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the members' process ended: {''.join(self.errors[-20:])}")
            if self.of("error") or time.monotonic() > deadline:
                return None
            time.sleep(0.02)
        return self.of(event, epoch)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class TcpStore:
    """A TCPStore hosted as ``gradsync.launch --store-only`` hosts it, and the bench's own client."""

    name = "TCPStore"

    def __init__(self):
        import torch.distributed as dist

        port = free_port()
        self.host = subprocess.Popen([sys.executable, "-m", "gradsync.launch", "--store-only", "--port", str(port)],
                                     stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
        said = []
        for line in self.host.stderr:  # (c10d may warn first)
            said.append(line)
            if "the job's store is at" in line:
                break
        else:
            self.close()
            raise RuntimeError(f"gradsync.launch --store-only did not start: {''.join(said)}")
        threading.Thread(target=lambda: [None for _ in self.host.stderr], daemon=True).start()
        self.address = f"127.0.0.1:{port}"
        self._client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))

    def add(self, key, n):
        return self._client.add(key, n)

    def set(self, key, value):
        self._client.set(key, value)

    def count(self, key):
        return int(self._client.get(key)) if self._client.check([key]) else 0

    def close(self):
        self.host.kill()
        self.host.wait()


class Etcd:
    """An etcd server of the bench's own (a fresh data directory), and its client."""

    name = "etcd"

    def __init__(self):
        from gradsync._native import EtcdClient

        binary = os.environ.get("GRADSYNC_ETCD") or shutil.which("etcd")
        if not binary:
            raise RuntimeError("no etcd binary: set GRADSYNC_ETCD (scripts/debian-binary.sh etcd-server etcd)")
        self._dir = tempfile.mkdtemp(prefix="gradsync-etcd-")
        client, peer = (f"http://127.0.0.1:{free_port()}" for _ in range(2))
        self.proc = subprocess.Popen(
            [binary, "--data-dir", self._dir, "--listen-client-urls", client, "--advertise-client-urls", client,
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer, "--initial-cluster",
             f"default={peer}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        endpoint = client.removeprefix("http://")
        deadline = time.monotonic() + 30
        while True:
            try:
                self._client = EtcdClient(endpoint, "", timeout_s=30.0)
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        self.address = f"etcd://{endpoint}"

    def add(self, key, n):
        return self._client.add(key, n)

    def set(self, key, value):
        self._client.set(key, value.encode())

    def count(self, key):
        value = self._client.get(key)
        return int(value) if value else 0

    def close(self):
        self.proc.kill()
        self.proc.wait()
        shutil.rmtree(self._dir, ignore_errors=True)


def command(store, job, text):
    """Tell the members' processes ``text`` through the store."""
    n = store.add(f"{job}/test/cmds", 1)
    store.set(f"{job}/test/cmd/{n}", text)


def beat_period(store, job, ids, over_s=2.0):
    """The median time between two beats of ``ids`` (their counts read twice, ``over_s`` apart)."""
    key = f"{job}/membership/beat/{{}}"
    before = {m: store.count(key.format(m)) for m in ids}
    time.sleep(over_s)
    return statistics.median(over_s / max(store.count(key.format(m)) - before[m], 1) for m in ids)


def loss(members, epoch, gone, lost_at, survivors):
    """The change to ``epoch`` after member ``gone`` was lost at
    ``lost_at``: ``(detection, agreement, left out)`` in seconds and members."""
    rosters = members.wait_for("roster", survivors, epoch) or members.of("roster", epoch)
    errors = members.of("error")
    right = [r for r in rosters if r["world"] == survivors and r["lost"] == [gone]]
    left_out = (survivors - len(right)) if len({r["digest"] for r in right}) <= 1 else survivors
    broke = [e["t"] for e in members.of("broke", epoch - 1)]
    if not broke or not rosters:
        return None, None, max(left_out, len(errors)), None
    # How long the news took to reach every survivor (the last one's monitor, or its loop), for the record.
    spread = max(broke) - min(broke)
    return min(broke) - lost_at, max(r["t"] for r in rosters) - min(broke), max(left_out, len(errors)), spread


def scenario(store, first, procs, healthy_s=3.0):
    """One run (see the module docs) of ``first`` members on ``store``: a row of the table."""
    job = f"scale{first}-{os.getpid()}"
    victim = first - 1
    began = time.monotonic()
    members = Members(store.address, job, first, procs, victim)
    try:
        started = members.wait_for("started", first, within_s=300.0)
        if started is None:
            raise RuntimeError(f"only {len(members.of('started'))} of {first} members started: {members.of('error')[:3]}")
        start_s = time.monotonic() - began
        period = beat_period(store, job, range(0, first, max(1, first // 16)))
        time.sleep(healthy_s)
        healthy_breaks = len(members.of("broke"))
        silent = first // 3
        lost_at = time.time()
        command(store, job, f"silence {silent}")
        silent_row = loss(members, 1, silent, lost_at, first - 1)
        pid = next(e["pid"] for e in started if e["member"] == victim)
        lost_at = time.time()
        os.kill(pid, signal.SIGKILL)
        killed_row = loss(members, 2, victim, lost_at, first - 2)
        command(store, job, "quit")
        members.proc.wait(timeout=60)
    finally:
        members.stop()
    return {
        "errors": [f"member {e['member']}: {e['message']}" for e in members.of("error")][:5],
        "store": store.name, "members": first, "procs": procs, "start_s": start_s, "beat_period_s": period,
        "healthy_breaks": healthy_breaks,
        "silent": dict(zip(("detection_s", "agreement_s", "left_out", "news_spread_s"), silent_row)),
        "killed": dict(zip(("detection_s", "agreement_s", "left_out", "news_spread_s"), killed_row)),
    }


def capacity(store, members=64, procs=4, over_s=3.0):
    """How many beats a second ``store`` answers: ``members`` real members
    beating every millisecond (as fast as their calls return), their
    heartbeat counts read twice, ``over_s`` apart."""
    job = f"capacity-{os.getpid()}"
    crowd = Members(store.address, job, members, procs, members - 1, liveness_s=600.0, beat_s=0.001)
    try:
        if crowd.wait_for("started", members, within_s=300.0) is None:
            raise RuntimeError("the capacity run's members did not start")
        time.sleep(1.0)
        key = f"{job}/membership/beat/{{}}"
        before = [store.count(key.format(m)) for m in range(members)]
        time.sleep(over_s)
        after = [store.count(key.format(m)) for m in range(members)]
    finally:
        crowd.stop()
    return {"store": store.name, "members": members, "beats_per_s": (sum(after) - sum(before)) / over_s}


def table(rows):
    def s(v):
        return "-" if v is None else f"{v:.2f} s"

    lines = [("| store | members | beat period (median) | silent: detection | new roster after it | killed: detection "
             "| new roster after it | healthy members left out |"), "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        left = r["silent"]["left_out"] + r["killed"]["left_out"] + r["healthy_breaks"]
        lines.append(f"| {r['store']} | {r['members']} | {r['beat_period_s']:.3f} s | {s(r['silent']['detection_s'])} "
                     f"| {s(r['silent']['agreement_s'])} | {s(r['killed']['detection_s'])} "
                     f"| {s(r['killed']['agreement_s'])} | {left} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stores", nargs="+", default=["tcp", "etcd"], choices=["tcp", "etcd"])
    parser.add_argument("--members", nargs="+", type=int, default=[8, 32, 128, 512])
    parser.add_argument("--procs", type=int, default=8, help="processes the members run in (at most)")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--isolate", action="store_true", help="run in a private network namespace (see the docs)")
    parser.add_argument("--capacity", action="store_true",
                        help="also measure how many beats a second each store answers (64 members beating flat out)")
    args = parser.parse_args()
    if args.isolate and os.environ.get("GRADSYNC_ISOLATED") != "1":
        argv = [a for a in sys.argv if a != "--isolate"]
        script = "ip link set lo up && exec \"$@\""
        isolated = ["unshare", "-n", "sh", "-c", script, "sh", sys.executable, *argv]
        sys.exit(subprocess.run(isolated, env={**os.environ, "GRADSYNC_ISOLATED": "1"}, check=False).returncode)
    rows, capacities = [], []
    for kind in args.stores if args.capacity else []:
        store = TcpStore() if kind == "tcp" else Etcd()
        try:
            capacities.append(capacity(store))
        finally:
            store.close()
        print(f"{capacities[-1]['store']}: {capacities[-1]['beats_per_s']:.0f} beats a second at most", flush=True)
    for kind in args.stores:
        for n in args.members:
            store = TcpStore() if kind == "tcp" else Etcd()
            try:
                row = scenario(store, n, max(2, min(args.procs, n // 8)))
            finally:
                store.close()
            rows.append(row)
            print(table([row]).splitlines()[-1], flush=True)
            for error in row["errors"]:
                print(f"    {error}", file=sys.stderr, flush=True)
    print(table(rows))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        # The command as it was typed: inside the namespace, --isolate is gone from argv.
        isolated = ["--isolate"] if os.environ.get("GRADSYNC_ISOLATED") == "1" else []
        argv = ["benches/torch/membership_scale.py", *sys.argv[1:], *isolated]
        Path(args.json).write_text(json.dumps(
            {"bench": "membership_scale", "command": " ".join(argv), "beat_s": BEAT_S, "liveness_s": LIVENESS_S,
             "rows": rows, "capacity": capacities}, indent=1))


if __name__ == "__main__":
    main()
