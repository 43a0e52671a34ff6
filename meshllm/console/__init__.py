"""The web console: a single page of plain HTML, CSS and JavaScript modules, served by every node.

No build step and no third-party code: the files under ``static/`` are what the browser runs.
``meshllm.api.console`` serves them; docs/console.md describes the page.
"""

from __future__ import annotations

from importlib import resources

STATIC = "static"


def static_files() -> dict[str, bytes]:
    """Every file of the page by name (``index.html``, ``console.css``, ``*.js``)."""
    folder = resources.files(__package__) / STATIC
    return {entry.name: entry.read_bytes() for entry in folder.iterdir() if entry.is_file()}
