"""`meshllm mesh` and `meshllm invite` through the real console script, as a user runs them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from nodes import meshllm


def test_version() -> None:
    out = meshllm("--version")
    assert out.returncode == 0 and "meshllm" in out.stdout


def test_create_mesh_then_invite_then_inspect(tmp_path: Path) -> None:
    created = meshllm("mesh", "create", "--home", str(tmp_path))
    assert created.returncode == 0, created.stderr
    mesh_id = created.stdout.strip()
    assert mesh_id.startswith("mesh-") and len(mesh_id) == 31
    assert (tmp_path / "mesh.key").stat().st_mode & 0o777 == 0o600

    again = meshllm("mesh", "create", "--home", str(tmp_path))
    assert again.returncode == 1 and "already holds" in again.stderr and "Traceback" not in again.stderr

    made = meshllm("invite", "create", "--ttl", "2h", "--uses", "3", "--bootstrap", "127.0.0.1:9338",
                   "--home", str(tmp_path))
    assert made.returncode == 0, made.stderr
    token = made.stdout.strip()
    assert "\n" not in token and token

    shown = meshllm("invite", "inspect", token, "--json")
    info = json.loads(shown.stdout)
    assert info["mesh_id"] == mesh_id and info["max_uses"] == 3 and info["bootstrap"] == ["127.0.0.1:9338"]
    assert not info["expired"]
    human = meshllm("invite", "inspect", token)
    assert mesh_id in human.stdout and "expires" in human.stdout


@pytest.mark.parametrize("token", ["garbage", "bG9s" * 10])
def test_bad_token_is_one_line_error(token: str) -> None:
    out = meshllm("invite", "inspect", token)
    assert out.returncode == 1
    assert out.stderr.startswith("error: ") and "Traceback" not in out.stderr


def test_invite_without_mesh_key_says_what_to_do(tmp_path: Path) -> None:
    out = meshllm("invite", "create", "--home", str(tmp_path))
    assert out.returncode == 1 and "meshllm mesh create" in out.stderr


@pytest.mark.parametrize("args", [["invite", "create", "--ttl", "soon"], ["invite", "create", "--uses", "-1"],
                                  ["no-such-command"]])
def test_usage_errors_exit_2(tmp_path: Path, args: list[str]) -> None:
    meshllm("mesh", "create", "--home", str(tmp_path))
    out = meshllm(*args, "--home", str(tmp_path))
    assert out.returncode == 2 and "Traceback" not in out.stderr
