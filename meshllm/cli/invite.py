"""``meshllm invite``: create, inspect and revoke invite tokens."""

from __future__ import annotations

import time
from pathlib import Path

import click

from meshllm.cli.api_client import NodeApi
from meshllm.cli.common import (
    api_option,
    echo_json,
    home_dir,
    iso_utc,
    json_option,
    load_mesh_key,
    parse_duration,
)
from meshllm.errors import ConfigError, DecodeError
from meshllm.mesh.admission import Invite, encode_token, inspect_token
from meshllm.wire.addr import parse_addr


@click.group()
def invite() -> None:
    """Create, inspect and revoke invites to a mesh."""


@invite.command("create")
@click.option("--ttl", default="24h", show_default=True, help="Lifetime: 30m, 24h, 7d or seconds.")
@click.option("--uses", type=click.IntRange(min=0), default=1, show_default=True,
              help="How many nodes may join with it (0: unlimited).")
@click.option("--bootstrap", "bootstrap", multiple=True, metavar="HOST:PORT",
              help="Address of a member to dial (repeatable).")
@api_option(optional=True)
def create(home: Path | None, ttl: str, uses: int, bootstrap: tuple[str, ...], api: NodeApi | None) -> None:
    """Sign an invite with the mesh key; print the token alone on stdout.

    With --api, the running node signs it and names itself as the member to dial.
    """
    if api is not None:
        if bootstrap:
            raise click.UsageError("--bootstrap cannot be combined with --api (the node names itself)")
        answer = api.post_json("/api/invite", {"ttl_s": parse_duration(ttl), "max_uses": uses})
        click.echo(answer["token"])
        return
    folder = home_dir(home, create=False)
    key = load_mesh_key(folder)
    if key is None:
        raise ConfigError(f"no mesh key in {folder}",
                          hint="run `meshllm mesh create` first, or ask a running node with --api")
    for addr in bootstrap:
        _check_addr(addr)
    click.echo(encode_token(key.invite(time.time(), parse_duration(ttl), uses, list(bootstrap))))


def _check_addr(addr: str) -> None:
    try:
        parse_addr(addr)
    except DecodeError as exc:
        raise click.BadParameter(str(exc), param_hint="--bootstrap") from None


def describe(inv: Invite, now: float) -> dict[str, object]:
    """The fields of an invite a person or script wants to see."""
    return {
        "mesh_id": inv.mesh_id,
        "invite_id": inv.invite_id,
        "issued": iso_utc(inv.issued),
        "expires": iso_utc(inv.expires),
        "expired": now >= inv.expires,
        "max_uses": inv.max_uses,
        "bootstrap": list(inv.bootstrap),
    }


@invite.command("inspect")
@click.argument("token")
@json_option
def inspect(token: str, as_json: bool) -> None:
    """Check a token's signature and show what it admits to."""
    info = describe(inspect_token(token), time.time())
    if as_json:
        echo_json(info)
        return
    for key, value in info.items():
        if key == "max_uses" and value == 0:
            value = "unlimited"
        if key == "bootstrap":
            value = ", ".join(value) or "(none)"  # type: ignore[arg-type]
        click.echo(f"{key:>10}: {value}")


INVITE_ID_MAX_CHARS = 32
"""Longer arguments to ``invite revoke`` are taken as whole tokens (an invite id has 16 characters)."""


def post_revocation(api: NodeApi, kind: str, target: str, as_json: bool) -> None:
    """Ask the owner's node to revoke; print what was revoked."""
    answer = api.post_json("/api/revoke", {"kind": kind, "target": target})
    if as_json:
        echo_json(answer)
        return
    click.echo(f"revoked {answer['kind']} {answer['target']} in {answer['mesh_id']} "
               "(gossiped to every member; they refuse it from now on)")


@invite.command("revoke")
@click.argument("invite_ref", metavar="INVITE_ID_OR_TOKEN")
@api_option
@json_option
def revoke(invite_ref: str, api: NodeApi, as_json: bool) -> None:
    """Revoke an invite in the mesh of the node at --api; members then refuse joiners holding it.

    Takes an invite id (`meshllm invite inspect` shows it) or the whole token.
    """
    ref = invite_ref.strip()
    invite_id = inspect_token(ref).invite_id if len(ref) > INVITE_ID_MAX_CHARS else ref
    post_revocation(api, "invite", invite_id, as_json)
