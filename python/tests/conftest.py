"""Fixtures: persistent worlds of 2 and 3 ranks, fresh worlds for fault
cases, and the side-by-side table against real DDP that the suite writes."""

import json
import os
import pathlib

import pytest

from world import World

REPO = pathlib.Path(__file__).resolve().parents[2]
TABLE_DIR = REPO / "target" / "pytest"

# Rows of the side-by-side table, filled by the tests that run both DDP and gradsync.
ROWS = []


@pytest.fixture(scope="session")
def world2():
    w = World(2)
    yield w
    w.close()


@pytest.fixture(scope="session")
def world3():
    w = World(3)
    yield w
    w.close()


@pytest.fixture
def fresh_world():
    """A factory of worlds that are torn down after the test (for cases that
    kill a rank or leave a process group broken)."""
    made = []

    def make(size, pg_timeout_s=60):
        w = World(size, pg_timeout_s=pg_timeout_s)
        made.append(w)
        return w

    yield make
    for w in made:
        w.close()


@pytest.fixture
def side_by_side():
    """Record a row of the table: ``record(case, ddp_outcome, gradsync_outcome)``."""

    def record(case, ddp, gradsync):
        ROWS.append({"case": case, "ddp": ddp, "gradsync": gradsync})

    return record


def render_table(rows):
    lines = [
        "| case | torch DDP | gradsync (max abs diff from the single-process reference) |",
        "|---|---|---|",
    ]
    for row in rows:
        lines.append(f"| {row['case']} | {row['ddp']} | {row['gradsync']} |")
    return "\n".join(lines) + "\n"


def pytest_sessionfinish(session, exitstatus):
    if not ROWS:
        return
    TABLE_DIR.mkdir(parents=True, exist_ok=True)
    rows = sorted(ROWS, key=lambda r: r["case"])
    (TABLE_DIR / "ddp-side-by-side.json").write_text(json.dumps(rows, indent=1))
    (TABLE_DIR / "ddp-side-by-side.md").write_text(render_table(rows))
    if os.environ.get("GRADSYNC_PRINT_TABLE"):
        print("\n" + render_table(rows))
