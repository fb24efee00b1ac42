"""The membership protocol at a job's size: hundreds of real members
(``gradsync._native.Membership`` objects, as ``Elastic`` builds them, many
per process) against one store, on this machine
(``benches/torch/membership_scale.py`` runs the scenario).

512 members on one TCPStore hosted as ``gradsync.launch --store-only``
hosts it, 128 on etcd (512 under ``-m slow``, past this machine's etcd's
capacity: see that test): healthy for a while, nobody
is lost; then one member goes silent (its heartbeat stops, as a host whose
link is cut), then one is killed (its process SIGKILLed, no obituary). Each
time every other member adopts the same roster without exactly that member
(no healthy member is left out), and no healthy epoch breaks.

How fast is the bench's to print (``target/pytest/membership-scale.md``, the
docs' table), not this test's to judge on a busy two-core machine with the
tests' unoptimized build: there etcd's 128 members have been detected lost
in 1.2 to 7.0 s and agreed on in 1.3 to 5.3 s, where the docs' table says
a second and a third of one, because beats that come late widen each
peer's adaptive window (the detector waits rather than accuse a healthy
member). The protocol's timing is the Rust tests' (``membership/agreement_tests.rs``,
``monitor_tests.rs``, ``watch.rs``: a clock the test drives), and its cost
per member is counted there in store calls
(``a_change_among_512_members_costs_the_store_a_few_calls_per_member``).
A protocol that stops finishing fails here all the same: every survivor
must hold the new roster within the bench's wait (120 s).

The runs are isolated in a private network namespace when this process is
root (see the bench's docs: a resolver that drops lookups costs c10d 5 s
per connection); they are the measurements in ``target/pytest/membership-scale.md``.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benches" / "torch" / "membership_scale.py"
TABLE = ROOT / "target" / "pytest" / "membership-scale.md"
ROWS = {}


def run(tmp_path, store, members):
    out = tmp_path / "rows.json"
    isolate = ["--isolate"] if os.geteuid() == 0 and subprocess.run(
        ["unshare", "-n", "true"], capture_output=True).returncode == 0 else []
    proc = subprocess.run([sys.executable, str(BENCH), "--stores", store, "--members", str(members), "--json", str(out),
                           *isolate], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (row,) = json.loads(out.read_text())["rows"]
    ROWS[(row["store"], members)] = proc.stdout.strip().splitlines()[-1]
    TABLE.parent.mkdir(parents=True, exist_ok=True)
    header = proc.stdout.strip().splitlines()[-3:-1]
    TABLE.write_text("\n".join(header + [line for _, line in sorted(ROWS.items())]) + "\n")
    return row


def check(row):
    assert row["healthy_breaks"] == 0, f"a healthy job broke its epoch: {row}"
    for what in ("silent", "killed"):
        loss = row[what]
        assert loss["left_out"] == 0, f"{what}: healthy members left out: {row}"
        assert loss["detection_s"] is not None and loss["agreement_s"] is not None, f"{what}: never agreed on: {row}"


def test_512_members_on_one_tcpstore_lose_exactly_the_silent_and_the_killed_one(tmp_path):
    check(run(tmp_path, "tcp", 512))


def etcd_binary():
    import shutil

    binary = os.environ.get("GRADSYNC_ETCD") or shutil.which("etcd")
    if not binary:
        pytest.skip("no etcd binary: run scripts/test (it unpacks Debian's etcd-server) or set GRADSYNC_ETCD")


def test_128_members_on_etcd_lose_exactly_the_silent_and_the_killed_one(tmp_path):
    etcd_binary()
    check(run(tmp_path, "etcd", 128))


@pytest.mark.slow
def test_512_members_on_etcd_overload_this_machine_and_still_lose_exactly_the_silent_and_the_killed_one(tmp_path):
    """At 512, this machine's etcd is past its capacity (5120 beat
    transactions a second through its JSON gateway, on two cores shared
    with the members): beats come irregularly, the adaptive windows widen,
    and detection and agreement take seconds. What must still hold: no
    healthy member is left out, no healthy epoch breaks, and both losses
    are agreed on."""
    etcd_binary()
    row = run(tmp_path, "etcd", 512)
    assert row["healthy_breaks"] == 0, row
    for what in ("silent", "killed"):
        assert row[what]["left_out"] == 0 and row[what]["agreement_s"] is not None, row
