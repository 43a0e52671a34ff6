"""``meshllm models [list|pull|rm|load|unload]``: the models you can call, and the model files here and in the mesh.

``list`` (also plain ``meshllm models``) shows the models the mesh serves (from the running node at
``--api``) and the model files: this node's library (its home's ``models/`` and the folders in
``config.toml``) and what peers offer. ``pull REF`` puts a model into the library: ``hf:...`` is
downloaded from Hugging Face (resuming an interrupted download; a progress bar on a terminal, a
line per tenth otherwise, on stderr); a name or id a peer offers is
fetched from the mesh by the running node. ``rm ID`` forgets a model and deletes the files the
library made (never a file in your own folders). With ``--api`` the running node does the work;
without it, ``pull hf:...``, ``list`` and ``rm`` work on the home's library directly.

``load|unload`` change what the running node itself serves (its admin token is the authority; to
steer another node, use ``meshllm owner NODE ...``).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from meshllm.cli.api_client import DEFAULT_API, NodeApi, NodeUnreachable
from meshllm.cli.common import MeshllmGroup, api_option, echo_json, home_dir, json_option
from meshllm.cli.dashboard import fmt_bytes
from meshllm.cli.progress import progress_report
from meshllm.models.hub import is_hub_ref


@click.group("models", cls=MeshllmGroup, invoke_without_command=True)
@api_option(optional=True)
@json_option
@click.pass_context
def models(ctx: click.Context, api: NodeApi | None, as_json: bool, home: Path | None) -> None:
    """The models the mesh serves and the model files here and on peers (`list`), `pull` and `rm`; `load`/`unload`
    change what the running node serves."""
    if ctx.invoked_subcommand is None:
        _list(api, as_json, home)


@models.command("list")
@api_option(optional=True)
@json_option
def list_models(api: NodeApi | None, as_json: bool, home: Path | None) -> None:
    """Served models (with the nodes serving each) and model files: this node's library and what peers offer."""
    _list(api, as_json, home)


@models.command("pull")
@click.argument("ref")
@api_option(optional=True)
@json_option
def pull(ref: str, api: NodeApi | None, as_json: bool, home: Path | None) -> None:
    """Put REF into the library: hf:ORG/REPO/FILE.gguf, hf:ORG/REPO:QUANT, or (with --api) a name or id a peer has."""
    if api is not None:
        entry = _pull_through(api, ref)
    elif is_hub_ref(ref):
        from meshllm.api.model_routes import entry_json
        from meshllm.models.hub import pull as hub_pull
        from meshllm.models.library import Library

        with progress_report(f"pulling {ref}") as report:
            entry = entry_json(hub_pull(ref, Library.for_home(home_dir(home)), report=report))
    else:
        raise click.UsageError(f"{ref!r} is not an hf: reference; to fetch a model from the mesh, pass --api URL "
                               "of a running node")
    if as_json:
        echo_json(entry)
        return
    click.echo(f"{entry['name']}@{entry['id'][:12]}  {fmt_bytes(entry['size'])}  {entry['path']}")


@models.command("rm")
@click.argument("ref")
@api_option(optional=True)
@json_option
def rm(ref: str, api: NodeApi | None, as_json: bool, home: Path | None) -> None:
    """Forget model REF (a name or id); delete the files the library made (downloads, fetched models, stages)."""
    if api is not None:
        removed = api.request_json(f"/api/models/{ref}", method="DELETE")["removed"]
    else:
        from meshllm.api.model_routes import entry_json
        from meshllm.models.library import Library

        removed = [entry_json(e) | {"deleted": e.owned} for e in Library.for_home(home_dir(home)).remove(ref)]
        if not removed:
            raise click.ClickException(f"no model {ref!r} in the library of {home_dir(home)}")
    if as_json:
        echo_json(removed)
        return
    for e in removed:
        what = "deleted" if e["deleted"] else "forgotten (your file is left in place)"
        click.echo(f"{e['name']}@{e['id'][:12]} {e['kind']}: {what} {e['path']}")


def _pull_through(api: NodeApi, ref: str) -> dict[str, Any]:
    """Ask the node to pull ``ref``, drawing its transfer's progress from ``/api/status`` meanwhile."""
    result: dict[str, Any] = {}
    errors: list[BaseException] = []

    def work() -> None:
        try:
            result.update(api.post_json("/api/models/pull", {"ref": ref}, timeout=24 * 3600.0))
        except BaseException as exc:
            errors.append(exc)

    worker = threading.Thread(target=work, daemon=True)
    worker.start()
    with progress_report(f"pulling {ref}") as report:
        while worker.is_alive():
            worker.join(0.5)
            try:
                transfers = api.get_json("/api/status")["transfers"]
            except NodeUnreachable:
                continue
            running = [t for t in transfers if t["state"] in ("fetching", "verifying")]
            if running:
                report(running[0]["bytes_done"], running[0]["bytes_total"])
    if errors:
        raise errors[0]
    return result.get("entry") or {"id": result["id"], "name": result["name"], "path": result["path"],
                                   "size": Path(result["path"]).stat().st_size if Path(result["path"]).exists() else 0}


def _list(api: NodeApi | None, as_json: bool, home: Path | None) -> None:
    from meshllm.api.auto import AUTO  # the API's modules load slowly: only for this command

    node = api or NodeApi.for_cli(DEFAULT_API, None, home)
    served: list[dict[str, Any]] = []
    mesh: list[dict[str, Any]] = []
    names: dict[str, str] = {}
    try:
        listing = node.get_json("/v1/models")["data"]
        status = node.get_json("/api/status")
        own_id = status["node_id"]
        names = {p["node_id"]: p["name"] for p in status["peers"]}
        served = [_row(entry, own_id) for entry in listing if entry["id"] != AUTO]  # auto is a router, not a model
        library = node.get_json("/api/models")
        files, mesh = library["library"], library["mesh"]
    except NodeUnreachable:
        if api is not None:
            raise
        from meshllm.api.model_routes import entry_json
        from meshllm.models.library import Library

        files = [entry_json(e) for e in Library.for_home(home_dir(home)).entries()]
    if as_json:
        echo_json({"served": served, "files": files, "mesh": mesh})
        return
    console = Console(highlight=False)
    if served:
        table = Table(box=None, header_style="bold", title="Served in the mesh", title_justify="left")
        for column in ("MODEL", "CONTEXT", "NODES"):
            table.add_column(column)
        for row in served:
            nodes = ", ".join(f"{n['name']} (this node)" if n["local"] else n["name"] for n in row["nodes"])
            table.add_row(row["id"], str(row["context_length"] or "?"), nodes)
        console.print(table)
    elif api is not None:
        click.echo("No node of this mesh serves a model yet (start one with `meshllm serve --model REF`).")
    table = Table(box=None, header_style="bold", title="Model files", title_justify="left")
    for column in ("NAME", "ID", "SIZE", "KIND", "WHERE"):
        table.add_column(column)
    for f in files:
        kind = f"layers {f['layers'][0]}-{f['layers'][1]}" if f.get("layers") else "whole"
        table.add_row(f["name"], f["id"][:12], fmt_bytes(f.get("disk_bytes") or f["size"]), kind, f"here: {f['path']}")
    for offer in mesh:
        table.add_row(offer["name"], offer["model_id"][:12], fmt_bytes(offer["size"]), "whole",
                      f"peer {names.get(offer['node_id'], offer['node_id'][:8])}")
    if files or mesh:
        console.print(table)
    else:
        click.echo("No model files in the library (pull one: `meshllm models pull hf:ORG/REPO:QUANT`).")


def _row(entry: dict[str, Any], own_id: str) -> dict[str, Any]:
    """One model with its serving nodes, this node marked ``local``."""
    ids = entry.get("nodes", [])
    names = entry.get("node_names") or ids
    return {"id": entry["id"], "context_length": entry.get("context_length"),
            "nodes": [{"id": i, "name": n, "local": i == own_id} for i, n in zip(ids, names, strict=False)]}


@models.command("load")
@click.argument("model")
@api_option
@json_option
@click.option("--timeout", type=click.FloatRange(1.0, 3600.0), default=300.0, show_default=True,
              help="Seconds to wait for the model to load.")
def load(model: str, api: NodeApi, as_json: bool, timeout: float) -> None:
    """Load MODEL (a path, a library name or id, hf:..., or `default`) into the running node and serve it."""
    answer = api.post_json("/api/models/load", {"model": model}, timeout=timeout)
    if as_json:
        echo_json(answer)
    elif answer["loaded"]:
        click.echo(f"loaded {answer['model']} ({answer['engine']}, context {answer['context']}); "
                   "the mesh lists it within a gossip round")
    else:
        click.echo(f"{answer['model']} was already served")


@models.command("unload")
@click.argument("model")
@api_option
@json_option
@click.option("--timeout", type=click.FloatRange(0.0, 600.0), default=60.0, show_default=True,
              help="Seconds requests in flight may take to finish; those still running then are cancelled.")
def unload(model: str, api: NodeApi, as_json: bool, timeout: float) -> None:
    """Stop serving MODEL: no new request reaches it, running ones finish, then it is freed."""
    answer = api.post_json("/api/models/unload", {"model": model, "timeout_s": timeout}, timeout=timeout + 10.0)
    if as_json:
        echo_json(answer)
    elif answer["drained"]:
        click.echo(f"unloaded {answer['model']} after its requests finished ({answer['waited_s']:g} s)")
    else:
        click.echo(f"unloaded {answer['model']}; {answer['cancelled']} requests still running were cancelled")
