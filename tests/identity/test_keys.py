"""Node key: creation, reload, and refusing unsafe or damaged key files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from meshllm.config import NODE_KEY_FILE
from meshllm.errors import ConfigError
from meshllm.identity.ids import b32
from meshllm.identity.keys import NodeKey


def test_ephemeral_keys_are_fresh_and_named_by_their_public_key() -> None:
    a, b = NodeKey.ephemeral(), NodeKey.ephemeral()
    assert a.node_id != b.node_id
    assert a.node_id == b32(a.public) and len(a.node_id) == 52
    assert bytes(a.signing_key) not in repr(a).encode()


def test_load_or_create_writes_a_private_key_once(tmp_path: Path) -> None:
    first = NodeKey.load_or_create(tmp_path)
    path = tmp_path / NODE_KEY_FILE
    assert path.stat().st_mode & 0o777 == 0o600
    assert len(path.read_bytes()) == 32
    assert NodeKey.load_or_create(tmp_path).node_id == first.node_id
    assert NodeKey.load(tmp_path).node_id == first.node_id
    assert [p.name for p in tmp_path.iterdir()] == [NODE_KEY_FILE]  # no temp files left behind


def test_load_missing_key_says_so(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no node key"):
        NodeKey.load(tmp_path)


def test_key_readable_by_others_is_refused(tmp_path: Path) -> None:
    NodeKey.load_or_create(tmp_path)
    os.chmod(tmp_path / NODE_KEY_FILE, 0o644)
    with pytest.raises(ConfigError, match="accessible by other users") as info:
        NodeKey.load_or_create(tmp_path)
    assert "chmod 600" in info.value.hint


@pytest.mark.parametrize("size", [0, 31, 33, 64])
def test_key_of_wrong_size_is_refused(tmp_path: Path, size: int) -> None:
    path = tmp_path / NODE_KEY_FILE
    path.write_bytes(b"k" * size)
    os.chmod(path, 0o600)
    with pytest.raises(ConfigError, match=f"has {size} bytes"):
        NodeKey.load(tmp_path)


def test_unreadable_key_path_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / NODE_KEY_FILE).mkdir(mode=0o700)
    with pytest.raises(ConfigError, match="cannot read node key"):
        NodeKey.load(tmp_path)
