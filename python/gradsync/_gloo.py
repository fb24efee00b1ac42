"""What gradsync's communicators over gloo share, whichever framework runs
them: views of the runtime's memory by address, and the reading of gloo's
error messages. Needs neither torch nor Paddle."""

import ctypes

from gradsync._errors import _CollectiveFailed

#: The ctypes element type of each dtype the runtime hands over by address.
CTYPES = {"float32": ctypes.c_float, "int64": ctypes.c_int64}

# Substrings of gloo's messages when a peer process is gone.
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Connection refused")


class AddressArrays:
    """ctypes arrays over memory the runtime owns, by address. Building an
    array type is slow, so the types are kept by element type and length."""

    def __init__(self):
        self._types = {}

    def at(self, addr, numel, ctype=ctypes.c_float):
        """The ``numel`` elements at ``addr`` (valid as long as the runtime
        keeps that memory: the caller's contract)."""
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
