"""``meshllm auth``: the owner keystore, node certificates, the trust store and revocations.

Every command works on one home folder (``--home``). Commands that need the owner key read the
passphrase from ``$MESHLLM_OWNER_PASSPHRASE`` or prompt for it on a terminal.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import click

from meshllm.cli.common import (
    MeshllmGroup,
    ask_passphrase,
    echo_json,
    home_dir,
    home_option,
    iso_utc,
    json_option,
    parse_duration,
)
from meshllm.config import NODE_CERT_FILE, NODE_KEY_FILE, OWNER_KEYSTORE_FILE, write_private
from meshllm.errors import ConfigError, DecodeError, KeystoreError, VerificationError
from meshllm.identity.certs import (
    certificate_id,
    certificate_token,
    check_subject,
    check_validity,
    decode_certificate,
    issue_certificate,
    open_certificate,
    parse_certificate_token,
    verify_certificate,
)
from meshllm.identity.ids import b32, node_public_key
from meshllm.identity.keys import NodeKey
from meshllm.identity.keystore import (
    OWNER_KEYSTORE,
    PASSPHRASE_ENV,
    create_keystore,
    read_keystore,
    unlock_keystore,
)
from meshllm.identity.signing import encode_signed
from meshllm.identity.trust import TrustPolicy, TrustStore


def _passphrase(confirm: bool) -> str:
    """Env var, else a hidden prompt when stdin is a terminal (else a clear error)."""
    return ask_passphrase("Owner passphrase", env=PASSPHRASE_ENV, what=OWNER_KEYSTORE, confirm=confirm)


@click.group(cls=MeshllmGroup)
def auth() -> None:
    """Owner keys, node certificates and the trust store."""


@auth.command()
@home_option
@click.option("--force", is_flag=True, help="Replace an existing keystore (its owner key is lost).")
def init(home: Path | None, force: bool) -> None:
    """Create the owner keystore, and trust that owner on this node."""
    root = home_dir(home)
    path = root / OWNER_KEYSTORE_FILE
    if path.exists() and not force:  # checked here too, so we fail before asking for a passphrase
        raise KeystoreError(f"an owner keystore already exists at {path}",
                            hint="pass --force to replace it (the old owner key is lost)")
    key = create_keystore(path, _passphrase(confirm=True), force=force)
    owner = b32(bytes(key.verify_key))
    store = TrustStore.load(root)
    store.add_owner(owner, "this owner")
    store.save()
    click.echo(f"owner key created: {owner}")
    click.echo(f"  on your other nodes run: meshllm auth trust add {owner}")


@auth.command()
@home_option
@json_option
def status(home: Path | None, as_json: bool) -> None:
    """Show this node's id, owner, certificate and trust policy."""
    root = home_dir(home, create=False)
    info = _status(root, time.time())
    if as_json:
        echo_json(info)
        return
    click.echo(f"node id:      {info['node_id'] or '(none yet: created when the node first starts)'}")
    click.echo(f"owner key:    {info['owner_pub'] or '(none: run `meshllm auth init` to create one)'}")
    cert = info["certificate"]
    if cert is None:
        click.echo("certificate:  (none: run `meshllm auth sign-node`)")
    else:
        state = "valid" if cert["valid"] else f"INVALID: {cert['error']}"
        click.echo(f"certificate:  {state}; owner {cert.get('owner_pub', '?')[:8]}, "
                   f"expires {cert.get('expires_iso', '?')}, label {cert.get('label', '')!r}")
    trust = info["trust"]
    click.echo(f"trust policy: {trust['policy']} ({trust['owners']} trusted owners, "
               f"{trust['revoked']} revocations, {trust['allowlist']} allowlisted nodes)")


def _status(root: Path, now: float) -> dict[str, Any]:
    node_id = NodeKey.load(root).node_id if (root / NODE_KEY_FILE).exists() else None
    owner_pub = None
    if (root / OWNER_KEYSTORE_FILE).exists():
        owner_pub = b32(read_keystore(root / OWNER_KEYSTORE_FILE).public)
    cert: dict[str, Any] | None = None
    cert_path = root / NODE_CERT_FILE
    if cert_path.exists():
        cert = _cert_info(cert_path.read_bytes(), node_id, now)
    store = TrustStore.load(root)
    data = store.data
    return {
        "home": str(root),
        "node_id": node_id,
        "owner_pub": owner_pub,
        "certificate": cert,
        "trust": {
            "policy": str(data.policy),
            "owners": len(data.owners),
            "revoked": len(data.revoked_owners) + len(data.revoked_certs) + len(data.revoked_nodes),
            "allowlist": len(data.allowlist),
        },
    }


def _cert_info(data: bytes, node_id: str | None, now: float) -> dict[str, Any]:
    """What a stored certificate says, and whether it holds now (without raising)."""
    try:
        signed = decode_certificate(data)
        cert = open_certificate(signed)
    except (DecodeError, VerificationError) as exc:
        return {"valid": False, "error": str(exc)}
    info: dict[str, Any] = {"id": certificate_id(signed), "owner_pub": b32(cert.owner_pub), "node_id": cert.node_id,
                            "label": cert.label, "issued": cert.issued, "expires": cert.expires,
                            "expires_iso": iso_utc(cert.expires), "valid": True, "error": None}
    try:
        if node_id is not None:
            check_subject(cert, node_id)
        check_validity(cert, now)
    except VerificationError as exc:
        info.update(valid=False, error=str(exc))
    return info


@auth.command("sign-node")
@home_option
@click.option("--node-id", default=None, help="Certify another node; prints its certificate token.")
@click.option("--ttl", default="7d", show_default=True, help="Lifetime, e.g. 12h or 7d.")
@click.option("--label", default="", help="Free text shown to operators (e.g. host name).")
@json_option
def sign_node(home: Path | None, node_id: str | None, ttl: str, label: str, as_json: bool) -> None:
    """Sign a node certificate with the owner key (this node's by default, stored as node.cert)."""
    root = home_dir(home)
    lifetime = parse_duration(ttl)
    if node_id is not None:
        try:
            node_public_key(node_id.strip().lower())
        except DecodeError:
            raise click.BadParameter(f"{node_id[:20]!r} is not a node id", param_hint="--node-id") from None
    target = node_id.strip().lower() if node_id else NodeKey.load_or_create(root).node_id
    owner_key = unlock_keystore(root / OWNER_KEYSTORE_FILE, _passphrase(confirm=False))
    try:
        signed = issue_certificate(owner_key, target, time.time(), lifetime, label)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    cert = verify_certificate(signed, target, time.time())
    token = certificate_token(signed)
    if node_id is None:
        write_private(root / NODE_CERT_FILE, encode_signed(signed))
    out = {"node_id": target, "certificate_id": certificate_id(signed), "expires": cert.expires,
           "expires_iso": iso_utc(cert.expires), "stored": node_id is None, "token": token}
    if as_json:
        echo_json(out)
    elif node_id is None:
        click.echo(f"certified this node {target} until {out['expires_iso']}; stored in {root / NODE_CERT_FILE}")
    else:
        click.echo(f"# certificate for {target}, valid until {out['expires_iso']}; on that node run:")
        click.echo(f"meshllm auth install-cert {token}")


@auth.command("install-cert")
@home_option
@click.argument("token")
def install_cert(home: Path | None, token: str) -> None:
    """Install a certificate token issued for this node by `auth sign-node --node-id`."""
    root = home_dir(home)
    signed = parse_certificate_token(token)
    node = NodeKey.load_or_create(root)
    cert = verify_certificate(signed, node.node_id, time.time())
    write_private(root / NODE_CERT_FILE, encode_signed(signed))
    click.echo(f"installed certificate from owner {b32(cert.owner_pub)[:8]}, valid until {iso_utc(cert.expires)}")


@auth.group(cls=MeshllmGroup)
def trust() -> None:
    """Owners this node trusts, its allowlist and its policy."""


@trust.command("add")
@home_option
@click.argument("owner_pub")
@click.option("--label", default="", help="A name for this owner.")
def trust_add(home: Path | None, owner_pub: str, label: str) -> None:
    """Trust the owner key OWNER_PUB: nodes it certifies count as owned."""
    store = TrustStore.load(home_dir(home))
    store.add_owner(owner_pub, label)
    store.save()
    click.echo(f"trusting owner {owner_pub.strip().lower()}")


@trust.command("remove")
@home_option
@click.argument("owner_pub")
def trust_remove(home: Path | None, owner_pub: str) -> None:
    """Stop trusting OWNER_PUB (use `auth revoke --owner` to refuse its nodes outright)."""
    store = TrustStore.load(home_dir(home))
    store.remove_owner(owner_pub)
    store.save()
    click.echo(f"no longer trusting owner {owner_pub.strip().lower()}")


@trust.command("list")
@home_option
@json_option
def trust_list(home: Path | None, as_json: bool) -> None:
    """Show the policy, trusted owners, allowlist and revocations."""
    data = TrustStore.load(home_dir(home, create=False)).data
    if as_json:
        echo_json({"policy": str(data.policy),
                   "owners": [{"pub": o.pub, "label": o.label, "added": o.added} for o in data.owners],
                   "allowlist": data.allowlist, "revoked_owners": data.revoked_owners,
                   "revoked_certs": data.revoked_certs, "revoked_nodes": data.revoked_nodes})
        return
    click.echo(f"policy: {data.policy}")
    click.echo("trusted owners:" + ("" if data.owners else " (none)"))
    for owner in data.owners:
        click.echo(f"  {owner.pub}  {owner.label}")
    for title, items in [("allowlist", data.allowlist), ("revoked owners", data.revoked_owners),
                         ("revoked certificates", data.revoked_certs), ("revoked nodes", data.revoked_nodes)]:
        if items:
            click.echo(f"{title}:")
            for item in items:
                click.echo(f"  {item}")


@trust.command("policy")
@home_option
@click.argument("policy", type=click.Choice([p.value for p in TrustPolicy]))
def trust_policy(home: Path | None, policy: str) -> None:
    """Set the trust policy (off, prefer-owned, require-owned, allowlist); see docs/identity.md."""
    store = TrustStore.load(home_dir(home))
    store.set_policy(TrustPolicy(policy))
    store.save()
    click.echo(f"trust policy: {policy} (takes effect when the node next starts)")


@trust.command("allow")
@home_option
@click.argument("node_id")
def trust_allow(home: Path | None, node_id: str) -> None:
    """Put NODE_ID on the allowlist (used by the allowlist policy)."""
    store = TrustStore.load(home_dir(home))
    store.allow_node(node_id)
    store.save()
    click.echo(f"allowlisted node {node_id.strip().lower()}")


@trust.command("disallow")
@home_option
@click.argument("node_id")
def trust_disallow(home: Path | None, node_id: str) -> None:
    """Take NODE_ID off the allowlist."""
    store = TrustStore.load(home_dir(home))
    store.disallow_node(node_id)
    store.save()
    click.echo(f"removed node {node_id.strip().lower()} from the allowlist")


@auth.command()
@home_option
@click.option("--owner", "what", flag_value="owner", help="VALUE is an owner key.")
@click.option("--cert", "what", flag_value="cert", help="VALUE is a certificate id or token.")
@click.option("--node", "what", flag_value="node", help="VALUE is a node id.")
@click.argument("value")
def revoke(home: Path | None, what: str | None, value: str) -> None:
    """Refuse one node id (under every policy), or an owner's certificates or one certificate (all but off)."""
    if what is None:
        raise click.UsageError("say what VALUE is: --owner, --cert or --node")
    store = TrustStore.load(home_dir(home))
    if what == "owner":
        store.revoke_owner(value)
    elif what == "node":
        store.revoke_node(value)
    else:
        text = value.strip()
        store.revoke_certificate(text if len(text) == 64 else certificate_id(parse_certificate_token(text)))
    store.save()
    click.echo(f"revoked {what} {value.strip()[:64]}")
