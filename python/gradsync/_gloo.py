"""What gradsync's communicators over gloo share, whichever framework runs
them: positions in the job's store, epochs, and views of the runtime's
memory by address. Needs neither torch nor Paddle.

A communicator runs the runtime's collectives on a gloo group of gradsync's
own. Before each collective, a rank counts it in the store (``add(key, 1)``
under a key per rank and epoch): when a collective fails, the ranks whose
count is lower never reached it. After a failure every rank calls
``reset``: a new epoch, on a fresh group (the old group's connections hold
half-finished messages). The framework's communicator supplies the group
(:meth:`GlooCommunicator._new_group`) and the collective.

A failure is not classified here: the runtime does it, once, from facts
(actors/src/failure.rs): the ranks behind, the time waited
against the deadline. torch's C++ endpoint reads the ranks behind itself;
Paddle's communicator (Python) reports them with :meth:`GlooCommunicator.failure`.
Nobody reads gloo's wording.
"""

import ctypes

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

def never_free(obj):
    """Keep ``obj`` alive until the process ends, through interpreter
    shutdown too. For gloo groups of a broken epoch: a group whose work
    waits on a vanished peer cannot be destroyed without waiting out gloo's
    timeout (its destructor joins its worker threads), so a program that
    ends (or drops its wrapper) right after a membership change would hang
    in a destructor. Holding them in a list is not enough: the interpreter
    clears module globals and collects cycles at shutdown. An extra
    reference nobody owns leaves them to the operating system."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))
    return obj


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

    def _positions(self):
        """Where each rank counts the collectives it started in this epoch:
        this prefix and its rank."""
        return f"{self._prefix}/epoch{self._epoch}/position/"

    def _key(self, rank):
        """Where ``rank`` counts the collectives it started in this epoch."""
        return f"{self._positions()}{rank}"

    def _mark(self):
        """Count one more collective of this rank; returns its position."""
        return self._store.add(self._key(self.rank), 1)

    def _behind(self, mine):
        """Ranks whose count is below ``mine`` (they never reached that collective)."""
        try:
            return [r for r in range(self.world) if r != self.rank and self._store.add(self._key(r), 0) < mine]
        except Exception:  # the store itself is unreachable: nothing to say
            return []

    def failure(self, error, position):
        """What the runtime classifies a failed collective by: the error's
        message and the ranks that had not reached it (``position``: the
        count it was started at; judged against that collective, not the
        latest one started: later ones may already be on their way)."""
        text = str(error).strip()
        message = text.splitlines()[-1] if text else type(error).__name__
        return message, self._behind(position)

    def _array(self, addr, numel, dtype):
        # The runtime guarantees `addr` holds `numel` elements for this call;
        # the array shares that memory and does not outlive the collective.
        return self._arrays.at(addr, numel, dtype)

    def abandon(self):
        """The wrapper is closing: give up a collective still waiting for
        peers (a framework's communicator that can; by default nothing)."""

    def closed(self):
        """The runtime's threads have stopped (after :meth:`abandon`): a
        group still inside a collective that was given up is left to the
        process (a framework's communicator; by default nothing)."""

    def _new_group(self):
        """Open this epoch's group (the framework's)."""
        raise NotImplementedError

    def reset(self):
        """Start a new epoch on a fresh group (after a failed collective)."""
        self._epoch += 1
        self._new_group()
