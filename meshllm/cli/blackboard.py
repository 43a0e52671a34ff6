"""``meshllm blackboard``: post a note to the mesh blackboard, or read and search it.

With a MESSAGE the running node scrubs, signs and spreads it to every member; without one (or with
``--search``) the notes the node holds are listed, newest first. The node does the work over its
HTTP API (``/api/blackboard``), so this command only formats.
"""

from __future__ import annotations

import time
from typing import Any
from urllib.parse import urlencode

import click

from meshllm.cli.api_client import NodeApi
from meshllm.cli.common import api_option, echo_json, json_option, parse_duration


def _ago(ts: float) -> str:
    seconds = max(0.0, time.time() - ts)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit} ago"
    return f"{seconds:.0f}s ago"


def _line(note: dict[str, Any]) -> str:
    who = note["name"] or note["author"][:8]
    owner = f" (owner {note['owner'][:8]})" if note.get("owner") else ""
    return f"{_ago(note['ts']):>8}  {who}{owner}: {note['text']}"


@click.command("blackboard")
@click.argument("message", required=False)
@click.option("--search", "words", default="", metavar="WORDS",
              help="Notes containing every word (QUESTION:, STATUS:, FINDING:, TIP:, DONE: pick the kind).")
@click.option("--from", "author", default=None, metavar="NODE", help="Notes of one node (id, prefix or name).")
@click.option("--since", default=None, metavar="AGE", help="Notes of the last 30m, 6h, 2d ...")
@click.option("--limit", default=20, show_default=True, type=click.IntRange(1, 500), help="Notes to show at most.")
@api_option
@json_option
def blackboard(message: str | None, words: str, author: str | None, since: str | None, limit: int, api: NodeApi,
               as_json: bool) -> None:
    """Post MESSAGE to the mesh blackboard, or list and search its notes (they live 48 h)."""
    if message is not None:
        if words or author or since:
            raise click.UsageError("--search, --from and --since read the blackboard; they cannot go with a MESSAGE")
        note = api.post_json("/api/blackboard", {"text": message})
        if as_json:
            echo_json(note)
        else:
            click.echo(f"posted {note['id'][:12]} to the blackboard: {note['text']}")
        return
    params: dict[str, Any] = {"q": words, "limit": limit}
    if author:
        params["from"] = author
    if since:
        params["since_s"] = parse_duration(since)
    notes = api.get_json("/api/blackboard?" + urlencode(params))["notes"]
    if as_json:
        echo_json(notes)
    elif not notes:
        click.echo("no notes" + (" match" if words or author or since else " on the blackboard yet"))
    else:
        for note in notes:
            click.echo(_line(note))
