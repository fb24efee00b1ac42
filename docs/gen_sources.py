"""What every generator of the docs' numbers shares: where the sources live,
how a missing one is reported, and how a bench's JSON is read."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: Where the pytest suites write their tables (``scripts/test`` runs them).
PYTEST = ROOT / "target" / "pytest"


class Missing(RuntimeError):
    """A source a generated block needs is not there; the message says how to make it."""


def load(path: Path, command: str) -> dict:
    """The JSON a bench wrote at ``path``, or :class:`Missing` naming ``command``, which writes it."""
    if not path.is_file():
        raise Missing(f"{path.relative_to(ROOT)} is missing: run {command}")
    return json.loads(path.read_text())
