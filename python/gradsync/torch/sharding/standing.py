"""Where each member of a sharded elastic job stands at a change of members:
what ``reshard.settle`` decides the step and the move from (its step 1).

Every member needs the same few facts: which old place each new member
holds (the move's sources), the most optimizer steps a holder took, whether
the holders are apart, ready, or clipped. Gathering every member's record
for them cost each member O(world) bytes a change (100 to 200 bytes a
member, padded to the longest: 1 to 2 MB at 10,000). :func:`survey`
reduces them instead (1.5 KB a member at 10,000):

    extremes of 9 words ─▶ the top step, the fewest, all ready, the old world and stride, the first to clip
    a sum of 2 + world/62 words ─▶ how many are apart, how many hold, a bitmap of the old ranks held
    the highest of 1 word ─▶ whether the new ranks keep the old ranks' order (a roster keeps survivors
                             in order and appends joiners: then rank i holds the i-th old rank left)
    one broadcast, if a holder clipped or was asked to ─▶ its clipping

Where the holders' layouts differ (a change during a change left some laid
out anew) or the order is not the old one, every member's record is
gathered as before (:meth:`Standing.of`): the same answer, at its cost.
"""

from dataclasses import dataclass

import torch

#: A value past any step count or rank (for the holders' extremes, where a member holds nothing).
_FAR = 2**62
#: Old ranks per word of the bitmap (a sum of distinct bits is their union; 62 keeps it positive).
_BITS = 62


@dataclass(frozen=True)
class Standing:
    """The members' standing at a change (see the module docs)."""

    #: Per new rank: the old place it holds, ``(rank, world, stride)``, or ``None`` (a replacement).
    places: list
    #: The most optimizer steps a holder took.
    top: int
    #: Whether a holder took fewer.
    behind: bool
    #: Whether a holder is more than one step behind, or behind without the step's averages.
    apart: bool
    #: Whether every holder holds the step's averages.
    ready: bool
    #: The first holder's (in rank order) that clipped: ``((total, coef), its clip_asked)``; else ``None``.
    clipped: object
    #: When none clipped, the first holder's that was asked to clip:
    #: ``(max_norm, norm_type, indices)``; else ``None``.
    asked: object

    @classmethod
    def of(cls, everyone):
        """From every member's record (``record``), in rank order."""
        holders = [e for e in everyone if e["holds"]]
        top = max(e["taken"] for e in holders)
        behind = [e for e in holders if e["taken"] < top]
        clipped = next(((e["clipped"], e["asked"]) for e in holders if e["clipped"]), None)
        return cls(
            places=places_of(everyone),
            top=top,
            behind=bool(behind),
            apart=any(e["taken"] < top - 1 or not e["ready"] for e in behind),
            ready=all(e["ready"] for e in holders),
            clipped=clipped,
            asked=None if clipped else next((e["asked"] for e in holders if e["asked"]), None),
        )

    def layout_held(self):
        """The old world and buddy stride the first holder holds (for errors)."""
        return next(place[1:] for place in self.places if place is not None)


def places_of(everyone):
    """Per member of ``everyone`` (records, in rank order), the old place it
    holds: ``(rank, world, stride)``, or ``None``."""
    return [(e["rank"], e["world"], e["stride"]) if e["holds"] else None for e in everyone]


def record(part):
    """This member's record for :meth:`Standing.of`."""
    step = part.sharded_step
    return {"holds": step.holds, "rank": part.rank, "world": part.world, "stride": part.buddy_stride,
            "taken": step.taken, "ready": step.pending, "clipped": step.clipped, "asked": step.clip_asked}


def survey(part, states, rank, world):
    """Every member's :class:`Standing`, the same on each, from ``part`` (a
    ``sharding.partition.Partition`` in its old layout) on each member; this
    process is ``rank`` of ``world`` on ``states`` (the new state group).
    A collective of every member (see the module docs)."""
    step = part.sharded_step
    if world == 1:
        return Standing.of([record(part)])
    holds, taken = step.holds, step.taken
    high, low = states.extremes([
        taken if holds else -_FAR,
        taken if holds else _FAR,
        int(step.pending) if holds else 1,
        part.world if holds else -1,
        part.world if holds else _FAR,
        part.buddy_stride if holds else -1,
        part.buddy_stride if holds else _FAR,
        rank if holds and step.clipped else _FAR,
        rank if holds and step.clip_asked else _FAR,
    ])
    top, old_world, stride = high[0], high[3], high[5]
    if top == -_FAR or old_world != low[4] or stride != low[6]:
        return Standing.of(states.all_gather_objects(record(part)))  # (nobody holds, or the layouts differ)
    counts = torch.zeros(2 + -(-old_world // _BITS), dtype=torch.int64)
    if holds:
        counts[0] = int(taken < top and (taken < top - 1 or not step.pending))
        counts[1] = 1
        counts[2 + part.rank // _BITS] = 1 << (part.rank % _BITS)
    states.reduce(counts, "sum")
    holders = int(counts[1])
    held = _ranks_of(counts[2:].tolist())
    misplaced = (rank >= len(held) or held[rank] != part.rank) if holds else rank < holders
    if len(held) != holders or states.extremes([int(misplaced)])[0][0]:
        return Standing.of(states.all_gather_objects(record(part)))  # (the new ranks are not the old order)
    clipped = asked = None
    if low[7] < _FAR:
        clipped = states.broadcast_object((step.clipped, step.clip_asked) if rank == low[7] else None, low[7])
    elif low[8] < _FAR:
        asked = states.broadcast_object(step.clip_asked if rank == low[8] else None, low[8])
    return Standing(
        places=[(r, old_world, stride) for r in held] + [None] * (world - holders),
        top=top, behind=low[1] < top, apart=int(counts[0]) > 0, ready=low[2] == 1, clipped=clipped, asked=asked,
    )


def _ranks_of(words):
    """The ranks whose bits are set in ``words`` (:data:`_BITS` a word), in order."""
    ranks = []
    for w, word in enumerate(words):
        while word:
            low_bit = word & -word
            ranks.append(w * _BITS + low_bit.bit_length() - 1)
            word ^= low_bit
    return ranks
