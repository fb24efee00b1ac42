"""Elastic jobs: a lost rank does not end the job, a replacement rejoins.

Each test runs ``python -m gradsync.launch`` (the supervisor hosting the
job's store) over examples/torch/train_elastic.py on loopback, with ranks
killed (SIGKILL) or frozen (SIGSTOP: a host gone silent, its sockets open)
at a chosen step and phase. Every member writes a JSON report; rank 0's
says whether the survivors' parameters are bitwise identical and whether
one process replaying the same history (which steps were applied at which
world size) reaches the same parameters.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import without_exit_noise

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "torch" / "train_elastic.py"
# A run that takes longer than this is a hang, not a slow machine.
DEADLINE_S = 240
#: For runs that wait for a process to start and join (it imports torch: seconds): the members sleep
#: after each step, so the joiner has the cores and a few hundred steps cover the wait.
PACED = ("--pace-ms", "25")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(tmp_path, nproc, *script_args, rejoin=False, port=None, store=None):
    port = port or free_port()
    where = ["--store", store] if store else ["--port", str(port)]
    return [
        sys.executable, "-m", "gradsync.launch", "--nproc", str(nproc), *where,
        *(["--rejoin"] if rejoin else []), str(EXAMPLE), "--report", str(tmp_path / "out"), "--log-every", "100000",
        *script_args,
    ]


def reports(tmp_path):
    """Every member's report, by member id."""
    out = {}
    for f in tmp_path.glob("out.*"):
        if f.suffix not in (".killed", ".tmp"):
            r = json.loads(f.read_text())
            out[r["member"]] = r
    return out


def launch(tmp_path, nproc, *script_args, rejoin=False, store=None):
    proc = subprocess.run(command(tmp_path, nproc, *script_args, rejoin=rejoin, store=store), capture_output=True, text=True,
                          timeout=DEADLINE_S, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=tmp_path)
    return proc, reports(tmp_path)


def rank0(found):
    (first,) = [r for r in found.values() if r["rank"] == 0]
    return first


def explain(proc):
    out, err = without_exit_noise(proc.stdout), without_exit_noise(proc.stderr)
    return f"exit {proc.returncode}\n--- stdout\n{out[-3000:]}\n--- stderr\n{err[-3000:]}"


@pytest.mark.parametrize(
    "rank,phase,extra",
    # (Every phase, position and buffer setting under both policies: the slow matrix below.)
    [(0, "forward", ()), pytest.param(0, "boundary", (), marks=pytest.mark.slow),
     pytest.param(2, "backward", (), marks=pytest.mark.slow), (0, "optimizer", ("--buffer",))],
)
def test_survivors_go_on_when_a_rank_is_killed(tmp_path, rank, phase, extra):
    """Rank ``rank`` is SIGKILLed at step 4 in ``phase``: the two survivors
    agree on one membership, skip the step in flight on both, continue at
    world 2, end bitwise identical and equal to a replay of that history.
    ``--buffer``: the model has a buffer, sent from rank 0 at every step
    boundary (where rank 0's loss is recovered from)."""
    proc, found = launch(tmp_path, 3, "--steps", "8", "--kill", f"{rank}@4:{phase}", *extra)
    assert proc.returncode == 0, explain(proc)
    survivors = sorted(found)
    assert survivors == sorted({0, 1, 2} - {rank}), explain(proc)
    assert len({found[m]["digest"] for m in survivors}) == 1, "survivors differ"
    first = rank0(found)
    assert first["ok"] and first["identical"], explain(proc)
    applied = [s for s, *_ in first["history"]]
    skipped = sorted(set(range(8)) - set(applied))
    # The step in flight when it died; killed after its backward, it had contributed to step 4.
    expected = {"optimizer": [[5]], "collective": [[4], [5]]}.get(phase, [[4]])
    if phase == "optimizer" and extra:
        # Rank 0 died between steps: the survivors find out in step 5's
        # buffer broadcast, at the boundary, before any step is in flight.
        expected = [[]]
    assert skipped in expected, f"skipped {skipped}\n{explain(proc)}"
    changed_at = skipped[0] if skipped else 5
    assert [w for s, w, *_ in first["history"] if s >= changed_at] == [2] * (8 - changed_at - len(skipped))
    for m in survivors:
        (event,) = found[m]["events"]
        assert (event["kind"], event["lost"], event["step"]) == ("lost", [rank], changed_at)


# (The other phases under this policy are in the slow matrix below.)
@pytest.mark.parametrize("rank,phase", [(0, "backward"), pytest.param(1, "collective", marks=pytest.mark.slow)])
def test_under_the_partial_policy_the_survivors_reduce_the_lost_step_again(tmp_path, rank, phase):
    """abort_policy="partial": the step in flight when rank ``rank`` dies is
    not skipped but reduced again among the survivors from what each kept,
    the exact average over them (the replay sums exactly their shards);
    nothing is skipped, and the survivors stay bitwise identical."""
    proc, found = launch(tmp_path, 3, "--steps", "8", "--kill", f"{rank}@4:{phase}", "--abort-policy", "partial")
    assert proc.returncode == 0, explain(proc)
    first = rank0(found)
    assert first["ok"] and first["identical"], explain(proc)
    history = {s: (w, c, r) for s, w, c, r in first["history"]}
    survivors = [r for r in range(3) if r != rank]
    if phase != "collective":  # a collective kill may let one survivor apply the step first: skipped then
        assert sorted(history) == list(range(8)), f"nothing skipped\n{explain(proc)}"
    # The step in flight: drawn at world 3, summed over the two survivors' shards.
    lost_at = 5 if phase == "optimizer" else 4
    if lost_at in history:
        assert history[lost_at] == (3, 2, survivors), explain(proc)
    assert history[lost_at + 1] == (2, 2, [0, 1])


def exact(proc, found, survivors):
    """The job ended well with ``survivors`` (member ids), bitwise identical,
    equal to the replay, each applied step's gradient norm equal to the
    replay's (a step summed from two steps' batches shows there), and every
    survivor holding the same history. Returns rank 0's report."""
    assert proc.returncode == 0, explain(proc)
    assert sorted(found) == sorted(survivors), explain(proc)
    assert len({found[m]["digest"] for m in survivors}) == 1, f"survivors differ\n{explain(proc)}"
    first = rank0(found)
    assert first["ok"] and first["identical"] and not first["norms_off"], explain(proc)
    assert first["norms_compared"] > 0
    assert all(found[m]["history"] == first["history"] for m in survivors), "one history"
    return first


# Kills between steps (after the optimizer step) and inside it, with a
# buffer that rank 0 broadcasts at each boundary: the broadcast fails on
# rank 0 only, which recovers at the boundary while the others fail in the
# next step; they must meet on one step, never one step apart.
BETWEEN_STEPS = [
    (1, "between", ("--buffer",)),
    (2, "optimizer", ("--buffer",)),
    pytest.param(2, "boundary", ("--buffer", "--no-broadcast-buffers"), marks=pytest.mark.slow),
    # (The partial policy's case: test_under_the_partial_policy_a_kill_between_steps_skips_no_step.)
]


@pytest.mark.parametrize("shard", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["unsharded", "sharded"])
def test_under_the_partial_policy_a_kill_between_steps_skips_no_step(tmp_path, shard):
    """Rank 1 killed after its optimizer step, with a buffer rank 0
    broadcasts at each boundary: rank 0 fails in that broadcast, before the
    next step, and rank 2 in the next step's backward. Under the partial
    policy no survivor skips that step (it was skipped: rank 0 had no
    gradient of it to reduce again): both run it at the new world."""
    extra = ("--shard",) if shard else ()
    proc, found = launch(tmp_path, 3, "--steps", "12", "--kill", "1@4:between", "--buffer", "--abort-policy",
                         "partial", *extra)
    first = exact(proc, found, {0, 2})
    assert [s for s, *_ in first["history"]] == list(range(12)), f"no step skipped\n{explain(proc)}"


@pytest.mark.parametrize("rank,phase,extra", BETWEEN_STEPS)
def test_a_kill_between_steps_never_leaves_the_survivors_a_step_apart(tmp_path, rank, phase, extra):
    proc, found = launch(tmp_path, 3, "--steps", "12", "--kill", f"{rank}@4:{phase}", *extra)
    first = exact(proc, found, {0, 1, 2} - {rank})
    steps = [s for s, *_ in first["history"]]
    assert steps == sorted(set(steps)) and steps[-1] == 11, f"each step once, in order: {steps}"
    assert len(steps) >= 11, f"at most the step in flight is skipped: {steps}"


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["skip", "partial"])
@pytest.mark.parametrize("buffers", ["none", "broadcast", "own"])
@pytest.mark.parametrize("rank", [0, 1, 2])
@pytest.mark.parametrize("phase", ["forward", "backward", "collective", "optimizer", "between", "boundary"])
def test_every_phase_and_position_keeps_the_survivors_exact(tmp_path, phase, rank, buffers, policy):
    """The whole matrix (``-m slow``): every phase, rank 0, a middle and the
    last rank, no buffer, a broadcast buffer and a buffer each rank keeps,
    both policies; each run against its replay, norms included."""
    extra = {"none": (), "broadcast": ("--buffer",), "own": ("--buffer", "--no-broadcast-buffers")}[buffers]
    proc, found = launch(tmp_path, 3, "--steps", "10", "--kill", f"{rank}@4:{phase}", "--abort-policy", policy,
                         *extra)
    exact(proc, found, {0, 1, 2} - {rank})


def test_a_rank_that_raises_while_another_dies_does_not_hang_the_survivors(tmp_path):
    """Rank 1 is killed while rank 2 raises in the same forward: rank 2's
    heartbeat still beats while its interpreter shuts down, so the
    survivors' agreement may count it in and then wait for it in the new
    group's rendezvous. They give up on it there once it is gone and agree
    again, instead of waiting out gloo's timeout."""
    proc, found = launch(tmp_path, 4, "--steps", "10", "--kill", "1@4:forward", "--kill", "2@4:raise")
    first = exact(proc, found, {0, 3})
    assert [w for _, w, *_ in first["history"]][-1] == 2
    assert "a bug in this rank's forward" in proc.stderr, explain(proc)


def rejoined(proc, found):
    """Rank 1 of 3 was killed and replaced by member 3: the job ended well,
    the three members bitwise identical, the world 3, then 2, then 3 again.
    Returns rank 0's report."""
    assert proc.returncode == 0, explain(proc)
    assert sorted(found) == [0, 2, 3], explain(proc)
    assert len({r["digest"] for r in found.values()}) == 1
    first = rank0(found)
    assert first["ok"], explain(proc)
    worlds = [w for _, w, *_ in first["history"]]
    assert worlds[0] == 3 and 2 in worlds and worlds[-1] == 3, "3, then 2, then 3 again"
    return first


def test_a_replacement_rejoins_bitwise_equal_and_trains_exactly(tmp_path):
    """With --rejoin the supervisor starts a replacement; the members admit
    it at a step boundary and it receives the model, the optimizer's
    momentum and the step from a live member: afterwards all three are
    bitwise identical and the run equals its replay."""
    proc, found = launch(tmp_path, 3, "--steps", "300", *PACED, "--kill", "1@3:backward", rejoin=True)
    first = rejoined(proc, found)
    joiner = found[3]
    (joined,) = joiner["events"]
    assert joined["kind"] == "joined" and joined["world"] == 3
    # It started at the members' step, not at 0, and holds their history.
    assert joined["step"] > 3 and joiner["history"] == first["history"]


@pytest.mark.slow  # (etcd's default coverage: test_between_steps_kills_with_etcd)
def test_the_job_can_keep_its_membership_in_etcd(tmp_path, etcd_server):
    """--store etcd://...: the membership, the heartbeats and the obituaries
    live in etcd, and each epoch's rank 0 hosts its groups' rendezvous (no
    supervisor hosts anything); a killed rank's survivors go on and its
    replacement rejoins, exactly."""
    proc, found = launch(tmp_path, 3, "--steps", "300", *PACED, "--kill", "1@3:backward", rejoin=True,
                         store=f"etcd://{etcd_server}")
    assert "the job's store is etcd" in proc.stderr, explain(proc)
    rejoined(proc, found)


@pytest.mark.slow
@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("phase", ["forward", "backward", "collective", "optimizer", "between", "boundary"])
def test_every_phase_with_etcd_keeps_the_survivors_exact(tmp_path, etcd_server, phase, rank):
    """The matrix's kills with the membership in etcd (``-m slow``)."""
    proc, found = launch(tmp_path, 3, "--steps", "10", "--kill", f"{rank}@4:{phase}", "--buffer",
                         store=f"etcd://{etcd_server}")
    exact(proc, found, {0, 1, 2} - {rank})


@pytest.mark.parametrize("phase", ["between"])
def test_between_steps_kills_with_etcd(tmp_path, etcd_server, phase):
    """The same kill with the membership in etcd (the rejoin test kills mid-backward there)."""
    proc, found = launch(tmp_path, 3, "--steps", "12", "--kill", f"1@4:{phase}", "--buffer",
                         store=f"etcd://{etcd_server}")
    exact(proc, found, {0, 2})


def test_a_kill_racing_an_admission_leaves_everyone_exact(tmp_path):
    """Rank 1 dies, a replacement joins; at the first step after that join
    rank 0 dies too (the members just admitted the joiner and sent it their
    state): the survivors, the joiner among them, agree again, and the
    second replacement joins; the job ends exact."""
    proc, found = launch(tmp_path, 3, "--steps", "450", *PACED, "--kill", "1@3:backward", "--kill-after-join",
                         "0:boundary",
                         "--buffer", rejoin=True)
    assert proc.stderr.count("killed by SIGKILL") == 2, explain(proc)
    first = exact(proc, found, set(found))
    assert len(found) == 3 and 0 not in found and 1 not in found, explain(proc)
    assert first["history"][-1][1] == 3, "three members again at the end"


def members_and_an_odd_joiner(tmp_path, steps, *odd_args):
    """Two members train ``steps`` steps; meanwhile a process started by
    hand with ``odd_args`` asks to join. Returns the joiner's and the
    members' completed processes (stdout and stderr captured)."""
    port = free_port()
    cmd = command(tmp_path, 2, "--steps", str(steps), *PACED, port=port)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    members = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    try:
        odd = subprocess.run(
            [sys.executable, str(EXAMPLE), "--steps", str(steps), *PACED, *odd_args], capture_output=True, text=True,
            timeout=DEADLINE_S, cwd=tmp_path,
            env={**env, "GRADSYNC_STORE": f"127.0.0.1:{port}", "GRADSYNC_JOB": "gradsync-elastic",
                 "GRADSYNC_MEMBER": "99", "GRADSYNC_FIRST": "2", "GRADSYNC_JOIN": "1"},
        )
        out, err = members.communicate(timeout=DEADLINE_S)
    finally:
        if members.poll() is None:
            members.kill()
    return odd, subprocess.CompletedProcess(cmd, members.returncode, out, err)


def test_a_joiner_whose_collectives_differ_is_refused_and_the_members_go_on(tmp_path):
    """A replacement with the same model and optimizer but another bucket
    size passes the admission's fingerprint and then issues other
    collectives than the members (a desync in its first step). The members
    send it away (a membership event, not the job's end): it exits as
    refused, they skip that step and go on exact."""
    odd, members = members_and_an_odd_joiner(tmp_path, 300, "--bucket-mb", "0.02")
    assert odd.returncode == 4, f"{odd.stdout[-2000:]}\n{odd.stderr[-3000:]}"
    assert "(refused)" in odd.stderr and "right after it was admitted" in odd.stderr, odd.stderr[-2000:]
    assert members.returncode == 0, explain(members)
    found = reports(tmp_path)
    first = rank0(found)
    assert first["ok"] and not first["norms_off"], explain(members)
    kinds = [e["kind"] for e in first["events"]]
    assert kinds == ["joined", "refused"], kinds
    assert {w for _, w, *_ in first["history"]} == {2}, "no step was applied with the odd joiner"


def test_when_no_member_is_left_the_supervisor_ends_and_waiting_joiners_give_up(tmp_path):
    """Both members die at once; the supervisor had started a replacement
    for the first: it ends with a clear error instead of waiting for a job
    that has no members, and the supervisor exits 1 saying why."""
    proc, _ = launch(tmp_path, 2, "--steps", "50", "--kill", "0@3:forward", "--kill", "1@3:forward", rejoin=True)
    assert proc.returncode == 1, explain(proc)
    assert "no member of the job is left" in proc.stderr, explain(proc)
    assert "the job did not finish" in proc.stderr, explain(proc)
    if "started member 2" in proc.stderr:  # a replacement was started before the second death
        assert "(no_members)" in proc.stderr, explain(proc)


def test_first_members_that_never_start_are_lost_at_the_start_deadline(tmp_path):
    """A job of two machines whose second never starts (its host lost at
    start-up): the members that did start say whom they wait for, and at
    the start deadline go on without them, exactly, instead of waiting in
    silence for gloo's rendezvous."""
    cmd = command(tmp_path, 2, "--steps", "40", "--start-timeout", "4", "--log-every", "10")
    cmd[3:3] = ["--nnodes", "2", "--node-rank", "0"]
    began = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=DEADLINE_S,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=tmp_path)
    found = reports(tmp_path)
    first = exact(proc, found, {0, 1})
    (event,) = first["events"]
    assert (event["kind"], event["lost"], event["world"]) == ("lost", [2, 3], 2)
    assert {w for _, w, *_ in first["history"]} == {2}
    assert "did not reach epoch 0's groups" in proc.stderr, explain(proc)
    assert time.time() - began < 4 + 60, "the deadline, then training"


def test_an_epoch_broken_at_start_up_is_recovered_from_not_raised(tmp_path):
    """Membership epoch 0 breaks while the members start (a member that
    seemed silent on a loaded machine), before the sharded optimizer's
    check that every rank built the same one: the check waits for the
    first step boundary, where the members recover, and the job trains
    exactly; nothing internal reaches the program."""
    proc, found = launch(tmp_path, 3, "--steps", "20", "--shard", "--break-at-start")
    first = exact(proc, found, {0, 1, 2})
    assert [e["lost"] for e in first["events"]] == [[]], "one change of epoch, nobody lost"
    assert "Abandoned" not in proc.stderr and "Traceback" not in proc.stderr, explain(proc)


def test_a_fixed_global_batch_divides_by_the_first_world(tmp_path):
    proc, found = launch(tmp_path, 3, "--steps", "8", "--kill", "2@3:backward", "--fixed-global-batch")
    assert proc.returncode == 0, explain(proc)
    first = rank0(found)
    assert first["ok"], explain(proc)
    assert [c for _, _, c, _ in first["history"]][-1] == 2, "two contributors, divided by three (the replay's check)"


def woken_after_a_freeze(tmp_path, *script_args):
    """Run the example on 3 ranks with ``script_args``, one of whose kills
    freezes a rank (SIGSTOP); once the two survivors reported, wake it
    (SIGCONT) and wait for the job's end. Returns the supervisor's process,
    its output and error, and the frozen rank's kill mark (pid, time)."""
    cmd = command(tmp_path, 3, *script_args)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=tmp_path)
    try:
        killed = tmp_path / "out.killed"
        began = time.time()
        while not killed.exists() or not killed.read_text():
            assert proc.poll() is None and time.time() - began < DEADLINE_S, "the freeze never came"
            time.sleep(0.05)
        frozen = json.loads(killed.read_text())
        while len(reports(tmp_path)) < 2:
            assert proc.poll() is None and time.time() - began < DEADLINE_S, "the survivors never finished"
            time.sleep(0.05)
        os.kill(frozen["pid"], signal.SIGCONT)
        out, err = proc.communicate(timeout=DEADLINE_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc, out, err, frozen


@pytest.mark.parametrize("rank,phase,extra",
                         [(1, "freeze", ()), pytest.param(0, "stall", ("--buffer",), marks=pytest.mark.slow)])
def test_a_silent_rank_is_found_by_the_liveness_check_and_the_minority_leaves(tmp_path, rank, phase, extra):
    """A rank frozen with SIGSTOP keeps its sockets open, as a host whose
    link was cut: gloo alone would wait out its timeout. The survivors'
    liveness monitors see its heartbeat stop and go on within 2 s; when the
    frozen process wakes up, it finds the job went on without it and leaves
    (exit status 3), which the supervisor does not count as a failure.
    ``stall``: rank 0 freezes after its optimizer step, so the others wait
    for it in the next boundary's buffer broadcast (from rank 0): that wait
    is abandoned too."""
    proc, out, err, frozen = woken_after_a_freeze(tmp_path, "--steps", "300", "--kill", f"{rank}@5:{phase}", *extra)
    found = reports(tmp_path)
    assert proc.returncode == 0, f"{out[-2000:]}\n{err[-3000:]}"
    assert sorted(found) == sorted({0, 1, 2} - {rank})
    first = rank0(found)
    assert first["ok"], f"{out[-2000:]}\n{err[-3000:]}"
    (event,) = first["events"]
    assert event["lost"] == [rank]
    detected = event["time"] - frozen["time"]
    print(f"rank {rank} frozen ({phase}): the survivors went on {detected:.2f} s after the freeze")
    assert detected < 2.0, f"survivors went on {detected:.2f} s after the freeze"
    assert f"member {rank}: left the job" in err and "was left out of epoch" in err, err[-3000:]


def test_a_joiner_with_another_model_is_refused_and_the_members_go_on(tmp_path):
    odd, members = members_and_an_odd_joiner(tmp_path, 300, "--width", "48")
    assert odd.returncode == 4, f"{odd.stdout[-2000:]}\n{odd.stderr[-3000:]}"
    assert "was refused by the job" in odd.stderr and "are not the members'" in odd.stderr, odd.stderr[-2000:]
    assert members.returncode == 0, explain(members)
    first = rank0(reports(tmp_path))
    assert first["ok"] and {w for _, w, *_ in first["history"]} == {2}, "the members never changed"


def busy_loops(n):
    """``n`` processes spinning on the CPU (a loaded machine)."""
    spin = "import time\nend = time.time() + 3600\nwhile time.time() < end:\n    pass\n"
    return [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(n)]


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_soak_under_cpu_contention_no_member_is_lost(tmp_path):
    """Busy loops on every core (twice as many as cores) while 3 ranks train
    2000 steps with no kill: the liveness check must not mistake a slow
    process for a lost one (zero membership changes)."""
    loops = busy_loops(2 * (os.cpu_count() or 2))
    try:
        proc, found = launch(tmp_path, 3, "--steps", "2000", "--buffer")
    finally:
        for p in loops:
            p.kill()
    first = exact(proc, found, {0, 1, 2})
    events = [e for r in found.values() for e in r["events"]]
    assert not events, f"membership changed with nobody lost: {events}"
    print(f"soak under load: {len(first['history'])} steps, no membership change")


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("policy,load", [("skip", False), ("partial", False), ("partial", True)])
def test_soak_twenty_kills_each_followed_by_a_rejoin(tmp_path, policy, load):
    """4 ranks with a broadcast buffer, 20 kills at random ranks and phases
    (between steps too), each followed by a rejoin before the next (20
    joins); no survivor restarts; the final members equal the replay,
    gradient norms included (under the partial policy, lost steps averaged
    over the survivors). ``load``: busy loops on every core meanwhile. Run
    with ``pytest -m slow`` (minutes)."""
    import random

    rng = random.Random(34)
    spacing = 250  # steps between kills: a replacement starts (imports torch) and joins in between
    phases = ['forward', 'backward', 'collective', 'optimizer', 'between', 'boundary']
    kills = [f"{rng.randrange(4)}@{30 + i * spacing}:{rng.choice(phases)}" for i in range(20)]
    args = ["--steps", str(30 + 20 * spacing + 100), "--abort-policy", policy, "--buffer"]
    for k in kills:
        args += ["--kill", k]
    loops = busy_loops(2 * (os.cpu_count() or 2)) if load else []
    try:
        proc = subprocess.run(command(tmp_path, 4, *args, rejoin=True), capture_output=True, text=True,
                              timeout=3600, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=tmp_path)
    finally:
        for p in loops:
            p.kill()
    found = reports(tmp_path)
    assert proc.returncode == 0, explain(proc)
    first = rank0(found)
    assert first["ok"] and first["identical"] and not first["norms_off"], explain(proc)
    joined = [e for e in first["events"] if e["kind"] == "joined"]
    assert len(joined) >= 20 or first["member"] >= 4, f"20 joins seen by rank 0: {len(joined)}"
    lost = [e for r in found.values() for e in r["events"] if e["kind"] == "lost"]
    assert proc.stderr.count("killed by SIGKILL") == 20, explain(proc)
    assert len(found) == 4 and lost, "four members at the end, none restarted but the killed"
    skipped = set(range(30 + 20 * spacing + 100)) - {s for s, *_ in first["history"]}
    print(f"soak, {policy} policy: {len(lost)} losses seen, {len(skipped)} steps skipped")
    if policy == "partial":
        # Only a kill inside the collectives can let a survivor apply the step before the loss, and
        # one between steps (with a buffer) makes the survivor that failed at the boundary skip the next.
        assert len(skipped) <= sum(k.endswith((":collective", ":between", ":optimizer")) for k in kills), sorted(skipped)
