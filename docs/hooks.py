"""mkdocs hooks: generated blocks (docs/gen.py) on every page, and a strict
check that the README's generated cost block is current."""

import sys
from pathlib import Path

from mkdocs.exceptions import PluginError

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gen  # noqa: E402


def on_config(config):
    """Fail the build when the README's cost table or chart no longer match the JSON."""
    stale = gen.readme_is_current()
    if stale is not None:
        raise PluginError(stale)
    return config


def on_page_markdown(markdown, page, config, files):
    """Expand ``<!-- gen: NAME -->`` markers; a missing source fails the build."""
    try:
        return gen.expand(markdown)
    except gen.Missing as e:
        raise PluginError(f"{page.file.src_uri}: {e}") from e
