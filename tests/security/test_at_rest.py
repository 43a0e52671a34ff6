"""Secrets at rest: the mesh key, the home folder and the admin token, through the real CLI and real nodes.

Findings reproduced (each failed on the original main): ``mesh.key`` (the mesh's signing key) was
a plaintext seed that nodes accepted at mode 0644 (``node.key`` at 0644 was refused), it could not
be kept encrypted, and a home folder created 0777 was left 0777.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from nodes import NodeProcess, meshllm, running_nodes, wait_until

from meshllm.mesh.admission import MeshKey

pytestmark = pytest.mark.timeout(120)

PASS = "correct horse battery staple"


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def exits(node: NodeProcess, timeout: float = 30.0) -> str:
    """Wait for a node that must refuse to start; its stderr."""
    code = node.proc.wait(timeout)
    wait_until(lambda: any(line.startswith("error:") for line in node.stderr), 5.0)  # the reader thread catches up
    assert code == 1, f"exit {code}: {''.join(node.stderr)}"
    return "".join(node.stderr)


def test_a_mesh_key_other_users_can_read_is_refused(tmp_path: Path) -> None:
    home = tmp_path / "home"
    assert meshllm("mesh", "create", "--home", str(home)).returncode == 0
    (home / "mesh.key").chmod(0o644)
    for args in (["mesh", "show"], ["invite", "create"]):
        out = meshllm(*args, "--home", str(home))
        assert out.returncode == 1 and "accessible by other users" in out.stderr and "chmod 600" in out.stderr
    with running_nodes() as nodes:
        nodes.append(NodeProcess(home, ["--client"], "loose"))
        stderr = exits(nodes[0])
    assert "mesh key" in stderr and "accessible by other users (mode 644)" in stderr and "Traceback" not in stderr


def test_the_mesh_key_can_be_kept_encrypted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "home"
    monkeypatch.setenv("MESHLLM_MESH_PASSPHRASE", PASS)
    made = json.loads(meshllm("mesh", "create", "--encrypt", "--json", "--home", str(home)).stdout)
    assert made["encrypted"] is True
    sealed = (home / "mesh.key").read_bytes()
    stored = json.loads(sealed)
    assert stored["kdf"] == "argon2id" and mode(home / "mesh.key") == 0o600
    key = MeshKey.load(home, PASS)
    assert key is not None and key.mesh_id == made["mesh_id"]
    assert key.signing_key.encode() not in sealed, "the seed is not in the file"
    token = meshllm("invite", "create", "--home", str(home)).stdout.strip()
    assert json.loads(meshllm("invite", "inspect", token, "--json").stdout)["mesh_id"] == made["mesh_id"]
    monkeypatch.delenv("MESHLLM_MESH_PASSPHRASE")
    shown = json.loads(meshllm("mesh", "show", "--json", "--home", str(home)).stdout)
    assert shown["mesh_id"] == made["mesh_id"] and shown["encrypted"] is True, "no passphrase needed to show it"
    with running_nodes() as nodes:
        nodes.append(NodeProcess(home, ["--client"], "locked"))
        assert "needs a passphrase" in exits(nodes[0]) and "MESHLLM_MESH_PASSPHRASE" in "".join(nodes[0].stderr)
        monkeypatch.setenv("MESHLLM_MESH_PASSPHRASE", "wrong passphrase")
        nodes.append(NodeProcess(home, ["--client"], "wrong"))
        assert "wrong passphrase for the mesh key" in exits(nodes[1])
        monkeypatch.setenv("MESHLLM_MESH_PASSPHRASE", PASS)
        nodes.append(NodeProcess(home, ["--client"], "unlocked"))
        assert nodes[2].wait_ready()["mesh_id"] == made["mesh_id"]
        assert nodes[2].ready["invite"], "the owner signs its invite with the unlocked key"
    assert meshllm("mesh", "encrypt", "--home", str(home)).returncode == 1, "already encrypted"
    assert meshllm("mesh", "decrypt", "--home", str(home)).returncode == 0
    assert len((home / "mesh.key").read_bytes()) == 32 and mode(home / "mesh.key") == 0o600
    assert meshllm("mesh", "encrypt", "--home", str(home)).returncode == 0
    assert MeshKey.stored(home) == (key.public, True)


def test_a_home_folder_others_can_enter_is_tightened(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    os.chmod(home, 0o777)
    out = meshllm("auth", "status", "--home", str(home))
    assert out.returncode == 0 and mode(home) == 0o700
    assert "tightened home folder" in out.stderr and "777" in out.stderr


def test_the_admin_token_is_private_stable_and_replaced_when_exposed(tmp_path: Path) -> None:
    home = tmp_path / "home"
    with running_nodes() as nodes:
        nodes.append(NodeProcess(home, ["--client"], "first"))
        nodes[0].wait_ready()
        token = nodes[0].admin_token
        nodes[0].terminate()
        assert mode(home / "admin.token") == 0o600 and len(token) >= 40
        nodes.append(NodeProcess(home, ["--client"], "again"))
        nodes[1].wait_ready()
        assert nodes[1].admin_token == token, "reused across restarts"
        nodes[1].terminate()
        (home / "admin.token").chmod(0o644)
        nodes.append(NodeProcess(home, ["--client"], "exposed"))
        nodes[2].wait_ready()
        assert nodes[2].admin_token != token and mode(home / "admin.token") == 0o600
        assert any("writing a new admin token" in e.get("message", "") for e in nodes[2].events if e["type"] == "log")
