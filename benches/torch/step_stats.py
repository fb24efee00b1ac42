"""What ``vs_ddp.py`` makes of the step times it records: which steps count,
medians split by the step that ran before, and gradsync against each other
policy round by round, with a confidence interval."""

import math
import statistics


def measured_window(steps, warmup, policies):
    """The steps the medians are taken over: after ``warmup``, whole rotations
    of the policy order only, so each policy is measured equally often in each
    position of a step. The position matters on a shared machine: a policy
    measured more often first than last would be favoured or penalized (on
    this 2-core machine gradsync's GPT-2 step took 1740 ms right after its own
    previous step and 2114 ms right after DDP's; DDP's 1800 and 1806)."""
    n = steps - warmup
    if n < policies:
        return warmup, steps
    return warmup, warmup + n - n % policies


def paired_difference(steps, others, level=0.95):
    """gradsync's steps against another policy's, round by round (interleaved
    runs: the two steps of a round ran back to back): the median of
    ``steps[i] - others[i]`` and a distribution-free ``level`` confidence
    interval for it, the sign test's: the k-th smallest and k-th largest
    difference, k the largest with P(Binomial(n, 1/2) < k) <= (1 - level) / 2.
    None below the rounds such an interval needs (6 at 95%). The verdict says
    which policy was faster, or that the interval holds 0."""
    d = sorted(a - b for a, b in zip(steps, others))
    n, tail = len(d), (1 - level) / 2
    k, below = 0, 0.0  # below: P(Binomial(n, 1/2) < k)
    while below + math.comb(n, k) / 2**n <= tail:
        below += math.comb(n, k) / 2**n
        k += 1
    if k == 0:
        return None
    low, high = d[k - 1], d[n - k]
    verdict = "faster" if high < 0 else "slower" if low > 0 else "within noise"
    return {"rounds": n, "median_s": statistics.median(d), "low_s": low, "high_s": high, "level": level,
            "verdict": verdict}


def split_by_predecessor(steps, after_own):
    """Median step time after the policy's own previous step and after
    another policy's, or None where the run has only one kind."""
    own = [t for t, a in zip(steps, after_own) if a]
    other = [t for t, a in zip(steps, after_own) if not a]
    if not own or not other:
        return None
    return statistics.median(own), statistics.median(other)


def paired_with_gradsync(policies):
    """:func:`paired_difference` of gradsync against every other policy that
    synchronizes and ran to the end."""
    mine = policies.get("gradsync", {}).get("step_s")
    if not mine:
        return {}
    return {p: paired_difference(mine, r["step_s"]) for p, r in policies.items()
            if p not in ("gradsync", "local") and r.get("step_s")}
