"""What gradsync's communicators over gloo share, whichever framework runs
them: positions in the job's store, epochs, the reading of gloo's errors,
and views of the runtime's memory by address. Needs neither torch nor Paddle.

A communicator runs the runtime's collectives on a gloo group of gradsync's
own. Before each collective, a rank counts it in the store (``add(key, 1)``
under a key per rank and epoch): when a collective fails, the ranks whose
count is lower never reached it, and the error names them. After a failure
every rank calls ``reset``: a new epoch, on a fresh group (the old group's
connections hold half-finished messages). The framework's communicator
supplies the group (:meth:`GlooCommunicator._new_group`) and the collective.
"""

import ctypes

from gradsync._errors import _CollectiveFailed

#: The ctypes element type of each dtype the runtime hands over by address
#: (the half-width wire types as their raw 16 bits).
CTYPES = {
    "float32": ctypes.c_float,
    "float64": ctypes.c_double,
    "int64": ctypes.c_int64,
    "bfloat16": ctypes.c_uint16,
    "float16": ctypes.c_uint16,
}

#: The element types whose sums are scaled (gradients; control words are not).
SCALED = ("float32", "float64")

# Substrings of gloo's messages when a peer process is gone.
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Connection refused")


class AddressArrays:
    """ctypes arrays over memory the runtime owns, by address. Building an
    array type is slow, so the types are kept by element type and length."""

    def __init__(self):
        self._types = {}

    def at(self, addr, numel, dtype="float32"):
        """The ``numel`` elements of ``dtype`` at ``addr`` (valid as long as
        the runtime keeps that memory: the caller's contract)."""
        ctype = CTYPES[dtype]
        array_type = self._types.get((ctype, numel))
        if array_type is None:
            array_type = self._types[(ctype, numel)] = ctype * numel
        return array_type.from_address(addr)


def collective_failure(error, tag, behind):
    """``error`` from a gloo collective as the runtime's failure: a timeout
    naming the ranks ``behind`` (those that never reached the collective), a
    peer gone (exactly one behind), or a backend error."""
    text = str(error).strip()
    message = text.splitlines()[-1] if text else type(error).__name__
    lowered = message.lower()
    # gloo says "Timed out waiting ...", "Application timeout caused pair
    # closure" (torch's) or "... TIMEOUT self_rank = ..." (Paddle's).
    if "timed out" in lowered or "timeout" in lowered:
        return _CollectiveFailed("timeout", f"{tag}: {message}", missing=behind)
    if any(s in message for s in _PEER_GONE) and len(behind) == 1:
        return _CollectiveFailed("peer_gone", f"{tag}: {message}", peer=behind[0])
    detail = f"; ranks {behind} had not reached it" if behind else ""
    return _CollectiveFailed("backend", f"{tag}: {message}{detail}")


class GlooCommunicator:
    """One rank's end of a gloo group of gradsync's own (see the module
    docs). ``store`` is the job's store, ``prefix`` a key prefix unique to
    the wrapped model and identical on every rank."""

    def __init__(self, *, store, prefix, rank, world):
        self.rank = rank
        self.world = world
        self._store = store
        self._prefix = prefix
        self._epoch = 0
        self._arrays = AddressArrays()

    def _key(self, rank):
        """Where ``rank`` counts the collectives it started in this epoch."""
        return f"{self._prefix}/epoch{self._epoch}/position/{rank}"

    def _mark(self):
        """Count one more collective of this rank; returns its position."""
        return self._store.add(self._key(self.rank), 1)

    def _behind(self, mine):
        """Ranks whose count is below ``mine`` (they never reached that collective)."""
        try:
            return [r for r in range(self.world) if r != self.rank and self._store.add(self._key(r), 0) < mine]
        except Exception:  # the store itself is unreachable: nothing to say
            return []

    def failure(self, error, tag, position):
        """A failed collective (gloo's ``error``; ``position`` the count it
        was started at) as the runtime's failure, naming the ranks that had
        not reached it. Judged against that collective, not the latest one
        started: later ones may already be on their way."""
        return collective_failure(error, tag, self._behind(position))

    def _array(self, addr, numel, dtype):
        # The runtime guarantees `addr` holds `numel` elements for this call;
        # the array shares that memory and does not outlive the collective.
        return self._arrays.at(addr, numel, dtype)

    def abandon(self):
        """The wrapper is closing: give up a collective still waiting for
        peers (a framework's communicator that can; by default nothing)."""

    def _new_group(self):
        """Open this epoch's group (the framework's)."""
        raise NotImplementedError

    def reset(self):
        """Start a new epoch on a fresh group (after a failed collective)."""
        self._epoch += 1
        self._new_group()
