"""``meshllm auth``: through CliRunner, and as a real subprocess."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from meshllm.cli.auth import auth
from meshllm.identity.certs import certificate_id
from meshllm.identity.keys import NodeKey

ENV = {"MESHLLM_OWNER_PASSPHRASE": "test passphrase"}


def run(*args: str, env: dict[str, str | None] | None = None) -> Result:
    return CliRunner().invoke(auth, list(args), env=ENV if env is None else env)


def ok(*args: str) -> str:
    result = run(*args)
    assert result.exit_code == 0, result.output
    return result.output


def test_init_creates_keystore_trusts_it_and_refuses_to_overwrite(tmp_path: Path) -> None:
    out = ok("init", "--home", str(tmp_path))
    owner = out.split("owner key created: ")[1].split()[0]
    assert (tmp_path / "owner.keystore").stat().st_mode & 0o777 == 0o600
    again = run("init", "--home", str(tmp_path))
    assert again.exit_code == 1 and "already exists" in again.output and "--force" in again.output
    assert "Traceback" not in again.output
    listed = json.loads(ok("trust", "list", "--json", "--home", str(tmp_path)))
    assert [o["pub"] for o in listed["owners"]] == [owner]
    out = ok("init", "--force", "--home", str(tmp_path))
    assert owner not in out


def test_init_without_passphrase_source_fails_in_one_line(tmp_path: Path) -> None:
    result = run("init", "--home", str(tmp_path), env={"MESHLLM_OWNER_PASSPHRASE": None})
    assert result.exit_code == 1
    assert result.output.startswith("error: the owner keystore needs a passphrase")
    assert not (tmp_path / "owner.keystore").exists()


def test_sign_node_and_status(tmp_path: Path) -> None:
    home = str(tmp_path)
    empty = json.loads(ok("status", "--json", "--home", home))
    assert empty["node_id"] is None and empty["certificate"] is None and empty["trust"]["policy"] == "prefer-owned"
    ok("init", "--home", home)
    out = json.loads(ok("sign-node", "--ttl", "2d", "--label", "lab", "--json", "--home", home))
    assert out["stored"] and out["node_id"] == NodeKey.load(tmp_path).node_id
    status = json.loads(ok("status", "--json", "--home", home))
    cert = status["certificate"]
    assert cert["valid"] and cert["label"] == "lab" and cert["expires"] - cert["issued"] == 2 * 86400
    assert cert["owner_pub"] == status["owner_pub"] and cert["id"] == out["certificate_id"]
    text = ok("status", "--home", home)
    assert "certificate:  valid" in text and status["node_id"] in text


def test_wrong_passphrase_is_one_line(tmp_path: Path) -> None:
    ok("init", "--home", str(tmp_path))
    result = run("sign-node", "--home", str(tmp_path), env={"MESHLLM_OWNER_PASSPHRASE": "nope"})
    assert result.exit_code == 1 and "wrong passphrase" in result.output
    assert not (tmp_path / "node.cert").exists()


def test_certificate_for_another_node_travels_as_a_token(tmp_path: Path) -> None:
    owner_home, node_home = tmp_path / "owner", tmp_path / "node"
    ok("init", "--home", str(owner_home))
    node_id = NodeKey.load_or_create(node_home).node_id
    out = ok("sign-node", "--node-id", node_id, "--home", str(owner_home))
    token = out.split("install-cert ")[1].split()[0]
    assert not (owner_home / "node.cert").exists()
    wrong = run("install-cert", token, "--home", str(tmp_path / "other"))
    assert wrong.exit_code == 1 and "is for node" in wrong.output
    ok("install-cert", token, "--home", str(node_home))
    assert json.loads(ok("status", "--json", "--home", str(node_home)))["certificate"]["valid"]


def test_sign_node_rejects_bad_node_id(tmp_path: Path) -> None:
    assert run("sign-node", "--node-id", "xyz", "--home", str(tmp_path)).exit_code == 2


def test_trust_commands(tmp_path: Path) -> None:
    home = str(tmp_path)
    owner = NodeKey.ephemeral().node_id
    node = NodeKey.ephemeral().node_id
    ok("trust", "add", owner, "--label", "alice", "--home", home)
    ok("trust", "policy", "require-owned", "--home", home)
    ok("trust", "allow", node, "--home", home)
    listed = json.loads(ok("trust", "list", "--json", "--home", home))
    assert listed["policy"] == "require-owned" and listed["owners"][0]["label"] == "alice"
    assert listed["allowlist"] == [node]
    assert "alice" in ok("trust", "list", "--home", home)
    ok("trust", "disallow", node, "--home", home)
    ok("trust", "remove", owner, "--home", home)
    assert json.loads(ok("trust", "list", "--json", "--home", home))["owners"] == []
    missing = run("trust", "remove", owner, "--home", home)
    assert missing.exit_code == 1 and "not in the trust store" in missing.output
    assert run("trust", "add", "bogus", "--home", home).exit_code == 1
    assert run("trust", "policy", "everyone", "--home", home).exit_code == 2


def test_revoke_commands(tmp_path: Path) -> None:
    home = str(tmp_path)
    ok("init", "--home", home)
    signed = json.loads(ok("sign-node", "--json", "--home", home))
    owner, node = NodeKey.ephemeral().node_id, NodeKey.ephemeral().node_id
    ok("revoke", "--owner", owner, "--home", home)
    ok("revoke", "--node", node, "--home", home)
    ok("revoke", "--cert", signed["token"], "--home", home)
    ok("revoke", "--cert", "ab" * 32, "--home", home)
    listed = json.loads(ok("trust", "list", "--json", "--home", home))
    assert listed["revoked_owners"] == [owner] and listed["revoked_nodes"] == [node]
    assert listed["revoked_certs"] == [signed["certificate_id"], "ab" * 32]
    assert signed["certificate_id"] == certificate_id((tmp_path / "node.cert").read_bytes())
    assert run("revoke", "somevalue", "--home", home).exit_code == 2


def _subprocess(entry: list[str], *args: str, home: Path) -> subprocess.CompletedProcess[str]:
    env = os.environ | ENV | {"MESHLLM_HOME": str(home)}
    return subprocess.run([sys.executable, *entry, *args], env=env, capture_output=True, text=True,
                          timeout=60, stdin=subprocess.DEVNULL)


def test_auth_group_as_a_real_process(tmp_path: Path) -> None:
    code = ["-c", "from meshllm.cli.auth import auth; auth(prog_name='meshllm auth')"]
    assert _subprocess(code, "init", home=tmp_path).returncode == 0
    assert _subprocess(code, "sign-node", home=tmp_path).returncode == 0
    status = _subprocess(code, "status", "--json", home=tmp_path)
    assert status.returncode == 0 and json.loads(status.stdout)["certificate"]["valid"]
    again = _subprocess(code, "init", home=tmp_path)
    assert again.returncode == 1 and again.stderr.startswith("error: an owner keystore already exists")


@pytest.mark.skipif(not all(importlib.util.find_spec(f"meshllm.cli.{m}") for m in ("mesh", "invite")),
                    reason="meshllm.cli.main imports mesh and invite, not written yet")
def test_auth_through_the_meshllm_command(tmp_path: Path) -> None:
    code = ["-m", "meshllm"]  # the same entry point as the `meshllm` console script
    result = _subprocess(code, "auth", "status", "--json", home=tmp_path)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["trust"]["policy"] == "prefer-owned"
    bad = _subprocess(code, "auth", "trust", "add", "bogus", home=tmp_path)
    assert bad.returncode == 1 and bad.stderr.count("\n") <= 2 and "Traceback" not in bad.stderr
