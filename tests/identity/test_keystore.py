"""Owner keystore: encryption round trip, wrong passphrase, tampering, passphrase sources."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import msgspec
import nacl.pwhash.argon2id as argon2id
import pytest
from hypothesis import given, settings
from identity_strategies import mutated, random_or_mutated
from nacl.signing import SigningKey

from meshllm.errors import DecodeError, KeystoreError
from meshllm.identity.keystore import (
    PASSPHRASE_ENV,
    create_keystore,
    decode_keystore,
    decrypt_keystore,
    encode_keystore,
    obtain_passphrase,
    read_keystore,
    unlock_keystore,
)

FAST = {"opslimit": argon2id.OPSLIMIT_MIN, "memlimit": argon2id.MEMLIMIT_MIN}
_KEY = SigningKey.generate()
_VALID = encode_keystore(_KEY, "correct horse", **FAST)


def test_round_trip_and_public_key_without_passphrase(tmp_path: Path) -> None:
    path = tmp_path / "owner.keystore"
    key = create_keystore(path, "pw", **FAST)
    assert path.stat().st_mode & 0o777 == 0o600
    assert read_keystore(path).public == bytes(key.verify_key)
    assert bytes(unlock_keystore(path, "pw")) == bytes(key)
    assert bytes(key) not in path.read_bytes()


def test_default_limits_are_recorded_in_the_file(tmp_path: Path) -> None:
    path = tmp_path / "owner.keystore"
    create_keystore(path, "pw")
    ks = read_keystore(path)
    assert ks.opslimit >= 2 and ks.memlimit >= 64 * 1024 * 1024


def test_wrong_passphrase_is_a_keystore_error(tmp_path: Path) -> None:
    path = tmp_path / "owner.keystore"
    create_keystore(path, "pw", **FAST)
    with pytest.raises(KeystoreError, match="wrong passphrase"):
        unlock_keystore(path, "PW")


def test_refuses_to_overwrite_without_force(tmp_path: Path) -> None:
    path = tmp_path / "owner.keystore"
    first = create_keystore(path, "pw", **FAST)
    with pytest.raises(KeystoreError, match="already exists"):
        create_keystore(path, "pw", **FAST)
    second = create_keystore(path, "pw", force=True, **FAST)
    assert bytes(unlock_keystore(path, "pw")) == bytes(second) != bytes(first)


def test_empty_passphrase_is_refused(tmp_path: Path) -> None:
    with pytest.raises(KeystoreError, match="empty passphrase"):
        create_keystore(tmp_path / "k", "", **FAST)


def test_missing_and_corrupt_files_are_keystore_errors(tmp_path: Path) -> None:
    with pytest.raises(KeystoreError, match="no owner keystore"):
        read_keystore(tmp_path / "absent")
    bad = tmp_path / "bad"
    bad.write_bytes(b"{not json")
    with pytest.raises(KeystoreError, match="malformed"):
        read_keystore(bad)


def _edit(field: str, value: object) -> bytes:
    doc = json.loads(_VALID)
    doc[field] = value
    return json.dumps(doc).encode()


@pytest.mark.parametrize(("field", "value", "match"), [
    ("v", 2, "version 2"),
    ("kdf", "scrypt", "unknown kdf"),
    ("memlimit", 1 << 40, "memlimit out of range"),
    ("opslimit", 1000, "opslimit out of range"),
    ("salt", "AAAA", "bad salt length"),
])
def test_header_outside_bounds_is_refused_before_any_kdf_work(field: str, value: object, match: str) -> None:
    with pytest.raises(DecodeError, match=match):
        decode_keystore(_edit(field, value))


def test_changed_kdf_limits_make_decryption_fail() -> None:
    ks = msgspec.structs.replace(decode_keystore(_VALID), opslimit=argon2id.OPSLIMIT_MIN + 1)
    with pytest.raises(KeystoreError, match="wrong passphrase"):
        decrypt_keystore(ks, "correct horse")


def test_swapped_public_key_is_detected() -> None:
    ks = msgspec.structs.replace(decode_keystore(_VALID), public=bytes(SigningKey.generate().verify_key))
    with pytest.raises(KeystoreError, match="inconsistent"):
        decrypt_keystore(ks, "correct horse")


def test_passphrase_from_env_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PASSPHRASE_ENV, "from-env")
    assert obtain_passphrase(confirm=True, prompt=lambda confirm: "typed") == "from-env"


def test_passphrase_prompt_is_used_without_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PASSPHRASE_ENV, raising=False)
    asked: list[bool] = []
    assert obtain_passphrase(confirm=True, prompt=lambda confirm: asked.append(confirm) or "typed") == "typed"
    assert asked == [True]


def test_no_env_and_no_terminal_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PASSPHRASE_ENV, raising=False)
    with pytest.raises(KeystoreError, match="no terminal") as info:
        obtain_passphrase(confirm=False, prompt=None)
    assert PASSPHRASE_ENV in info.value.hint


@settings(max_examples=2000, deadline=None)
@given(random_or_mutated([_VALID]))
def test_decoder_raises_only_decode_error(data: bytes) -> None:
    with contextlib.suppress(DecodeError):
        decode_keystore(data)


@settings(max_examples=300, deadline=None)
@given(mutated(_VALID))
def test_unlocking_a_mutated_file_fails_cleanly_or_yields_the_same_key(data: bytes) -> None:
    try:
        key = decrypt_keystore(decode_keystore(data), "correct horse")
    except (DecodeError, KeystoreError):
        return
    assert bytes(key) == bytes(_KEY)  # e.g. a flip inside JSON whitespace-equivalent text
