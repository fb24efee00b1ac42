"""The membership protocol at a job's size, in the docs (``docs/elastic.md``):

* ``membership-bench``: ``gradsync-bench membership --json`` (real monitors
  and agreements as threads of one process, one in-memory store with an
  injected round trip; 8 to 4096 members);
* ``membership-stores``: ``benches/torch/membership_scale.py --json`` (real
  members in processes against a real TCPStore and a real etcd, and how many
  beats a second each store answers at most);
* ``membership-extrapolation``: what those measurements say of 16k and 100k
  members, with the assumptions printed beside it;
* ``gloo-groups``: ``benches/torch/gloo_groups.py --json`` (the connections
  one of gradsync's gloo groups holds per member, beside torch's way).
"""

from __future__ import annotations

from gen_sources import ROOT, load

BENCH = ROOT / "docs" / "data" / "membership" / "bench.json"
STORES = ROOT / "docs" / "data" / "membership" / "stores.json"
BENCH_COMMAND = ("cargo run --release --features sim --bin gradsync-bench -- membership --json "
                 "> docs/data/membership/bench.json")
STORES_COMMAND = ("benches/torch/membership_scale.py --capacity --isolate "
                  "--json docs/data/membership/stores.json")
GROUPS = ROOT / "docs" / "data" / "groups.json"
GROUPS_COMMAND = "benches/torch/gloo_groups.py --json docs/data/groups.json"
#: Members per node in the extrapolation's node-voice column (eight GPUs a machine).
PER_NODE = 8


def _s(value) -> str:
    return "-" if value is None else f"{value:.2f} s"


def membership_bench() -> str:
    """The in-process bench's table: store calls per beat and per change, and the times."""
    run = load(BENCH, BENCH_COMMAND)
    lines = [
        ("| members | store round trip | store calls per beat (all members) | per member | beat period (median) "
        "| detection | news reaches every survivor | first / last roster | store calls per change, per member "
        "| healthy members left out |"),
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in run["rows"]:
        lines.append(
            f"| {r['members']} | {r['latency_ms']:g} ms | {r['calls_per_beat']:.0f} | "
            f"{r['calls_per_beat'] / r['members']:.2f} | {r['beat_period_s']:.3f} s | {_s(r['detection_s'])} | "
            f"{_s(r['news_s'])} | {_s(r['first_roster_s'])} / {_s(r['agreement_s'])} | "
            f"{r['change_calls'] / r['members']:.1f} | {r['left_out'] + r['healthy_breaks']} |")
    lines += ["", (f"`{BENCH_COMMAND.split(' >')[0]}`: every member a real `Monitor` (its own thread) and "
              "`Agreement`, all threads of one process on this machine's two cores, against one in-memory "
              "store whose every call first sleeps the round trip. Times are from the silent member's last "
              "beat (detection) and from that detection (the rest). Where the beat period rises above "
              f"{run['beat_s']:g} s, the two cores are full (thousands of threads): the store calls per beat "
              "are what a store sees, the times what this machine can run.")]
    return "\n".join(lines)


def _left_out(row: dict) -> int:
    """Healthy members a real-store scenario left out of a roster or took for lost."""
    return row["silent"]["left_out"] + row["killed"]["left_out"] + row["healthy_breaks"]


def membership_stores() -> str:
    """The real stores' table, and their capacity."""
    run = load(STORES, STORES_COMMAND)
    lines = [
        ("| store | members | beat period (median) | silent: detection | new roster after it | killed: detection "
        "| new roster after it | healthy members left out |"),
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in run["rows"]:
        left = _left_out(r)
        lines.append(
            f"| {r['store']} | {r['members']} | {r['beat_period_s']:.3f} s | {_s(r['silent']['detection_s'])} | "
            f"{_s(r['silent']['agreement_s'])} | {_s(r['killed']['detection_s'])} | "
            f"{_s(r['killed']['agreement_s'])} | {left} |")
    capacities = {c["store"]: c["beats_per_s"] for c in run.get("capacity", [])}
    capacity = "; ".join(f"{store} about {beats:,.0f}" for store, beats in capacities.items())
    lines += ["", (f"`{run['command']}`. How many beats a second each store answers at most (64 members beating "
              f"as fast as their calls return, on the same two cores): {capacity}.")]
    past = [r for r in run["rows"] if r["store"] in capacities
            and r["members"] / run["beat_s"] > capacities[r["store"]]]
    if past:
        named = ", ".join(f"{r['store']} at {r['members']}" for r in past)
        kept = all(_left_out(r) == 0 for r in past)
        lines[-1] += (f" Past that ({named}: more beats a second at a {run['beat_s']:g} s beat than the store "
                      "answers), beats fall behind, and detection and agreement take seconds"
                      + ("; no healthy member is left out even then" if kept else "")
                      + ". A longer beat (`beat_s`) or a faster store is the remedy.")
    return "\n".join(lines)


def membership_extrapolation() -> str:
    """Larger jobs, from the measured capacity and calls per change (the assumptions are in the text)."""
    stores = load(STORES, STORES_COMMAND)
    bench = load(BENCH, BENCH_COMMAND)
    beat_s = bench["beat_s"]
    largest = max(bench["rows"], key=lambda r: (r["members"], -r["latency_ms"]))
    per_change = largest["change_calls"] / largest["members"]
    lines = [
        ("| members | store | beats a second at a "
        f"{beat_s:g} s beat | the shortest beat one such store holds | with one voice per node of {PER_NODE} "
        "| one change's calls, in seconds of that store |"),
        "|---|---|---|---|---|---|",
    ]
    for members in (4_096, 16_384, 100_000):
        for c in stores.get("capacity", []):
            cap = c["beats_per_s"]
            need = members / beat_s
            shortest = max(beat_s, members / cap)
            voice = max(beat_s, members / PER_NODE / cap)
            lines.append(f"| {members:,} | {c['store']} | {need:,.0f} | {shortest:.2f} s | {voice:.2f} s | "
                         f"{members * per_change / cap:.1f} s |")
    lines += [
        "",
        ("Assumptions: a beat is one store call per member (measured above, at every size); a change costs "
        f"{per_change:.1f} calls per member (the bench's {largest['members']}-member row), taken to cost the "
        "store what a beat does; a store answers what it answered here (measured with its clients on the same "
        "two cores: a store on a host of its own does at least as well; a TCPStore serves from one thread, "
        "so more cores do not raise its ceiling); the liveness window should stay at about ten beats. The "
        "node-voice column assumes a node beats once for its processes, which gradsync does not do yet."),
    ]
    return "\n".join(lines)


def gloo_groups() -> str:
    """Sockets a member holds in one gloo group, and the time to make it:
    torch's group beside gradsync's (pairs connected on first use)."""
    run = load(GROUPS, GROUPS_COMMAND)
    names = {"torch": "torch's `ProcessGroupGloo`", "gradsync": "gradsync's (`_comm.gloo_group`)"}
    lines = ["| members | group | made in | sockets held: made | after an all-reduce | a broadcast | an all-gather |",
             "|---|---|---|---|---|---|---|"]
    for r in run["rows"]:
        lines.append(f"| {r['world']} | {names[r['way']]} | {r['made_s'] * 1e3:.1f} ms | {r['made']} "
                     f"| {r['all_reduce']} | {r['broadcast']} | {r['all_gather']} |")
    meta = run["meta"]
    lines.append(f"\nThe most over the members (processes forked from one, on one TCPStore), sockets counted from "
                 f"`/proc/self/fd`, the store's own connection aside; on {meta['machine'].split(', CPU')[0]}, torch "
                 f"{meta['torch']}; `{meta['command']}`.")
    return "\n".join(lines)
