"""Membership: the owner's credential, taking a grant, and keeping it across restarts."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from nacl.signing import SigningKey

from meshllm.errors import VerificationError
from meshllm.identity.ids import node_id
from meshllm.mesh.admission import decode_credential, encode_token, inspect_token, make_grant
from meshllm.mesh.membership import CREDENTIAL_FILE, join_mesh, own_mesh


def nid(key: SigningKey) -> str:
    return node_id(bytes(key.verify_key))


def test_the_owner_needs_no_grant_and_its_credential_names_it() -> None:
    key = SigningKey.generate()
    owner = own_mesh(key, None, time.time())
    assert owner.granted
    assert owner.admission().verify_member(nid(key), owner.proof, time.time()).via == "owner"


def test_a_joiner_takes_the_grant_of_its_admitter_and_keeps_it(tmp_path: Path) -> None:
    owner_key, key = SigningKey.generate(), SigningKey.generate()
    owner = own_mesh(owner_key, None, time.time())
    assert owner.mesh_key is not None
    token = encode_token(owner.mesh_key.invite(time.time(), ttl_s=60))
    joiner = join_mesh(key, token, time.time(), home=tmp_path)
    assert not joiner.granted
    grant = make_grant(owner_key, owner.proof, owner.mesh_id, nid(key), inspect_token(token).invite_id, time.time())
    assert joiner.take_grant(nid(key), nid(owner_key), grant, time.time())
    assert joiner.granted and not joiner.take_grant(nid(key), nid(owner_key), grant, time.time())  # first only
    assert (tmp_path / CREDENTIAL_FILE).stat().st_mode & 0o777 == 0o600
    # A restart reuses it (the invite has expired by then, the grant has not) ...
    again = join_mesh(key, token, time.time() + 3600, home=tmp_path)
    assert again.proof == joiner.proof and again.granted
    # ... but only with the same invite and the same node key.
    other_token = encode_token(owner.mesh_key.invite(time.time()))
    assert not join_mesh(key, other_token, time.time(), home=tmp_path).granted
    assert not join_mesh(SigningKey.generate(), token, time.time(), home=tmp_path).granted


def test_a_bad_grant_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    owner_key, key = SigningKey.generate(), SigningKey.generate()
    owner = own_mesh(owner_key, None, time.time())
    assert owner.mesh_key is not None
    token = encode_token(owner.mesh_key.invite(time.time()))
    joiner = join_mesh(key, token, time.time(), home=tmp_path)
    before = joiner.proof
    wrong = make_grant(owner_key, owner.proof, owner.mesh_id, nid(SigningKey.generate()),
                       inspect_token(token).invite_id, time.time())
    with pytest.raises(VerificationError):
        joiner.take_grant(nid(key), nid(owner_key), wrong, time.time())
    other_mesh = own_mesh(SigningKey.generate(), None, time.time())
    foreign = make_grant(owner_key, other_mesh.proof, owner.mesh_id, nid(key), inspect_token(token).invite_id,
                         time.time())
    with pytest.raises(VerificationError):
        joiner.take_grant(nid(key), nid(owner_key), foreign, time.time())
    assert joiner.proof == before and decode_credential(before).grant == b""
    assert not (tmp_path / CREDENTIAL_FILE).exists()
