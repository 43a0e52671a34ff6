"""``config.toml``: defaults, the ``speculate``, ``split_audit`` and ``[models.NAME]`` keys, clear errors for
bad settings."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from meshllm.config import (
    DEFAULT_DHT_BOOTSTRAP,
    DHT_BOOTSTRAP_ENV,
    Config,
    create_private,
    dht_bootstrap,
    load_config,
    write_private,
)
from meshllm.engine.recommended import Recommended
from meshllm.errors import ConfigError


def test_missing_file_means_defaults(tmp_path: Path) -> None:
    assert load_config(tmp_path) == Config()
    assert Config().speculate == "auto"


@pytest.mark.parametrize("mode", ["auto", "on", "off"])
def test_speculate_key(tmp_path: Path, mode: str) -> None:
    (tmp_path / "config.toml").write_text(f'speculate = "{mode}"\n')
    assert load_config(tmp_path).speculate == mode


@pytest.mark.parametrize("text", ['speculate = "sometimes"\n', "speculate = 1\n", 'speculation = "on"\n'])
def test_bad_settings_are_refused_by_name(tmp_path: Path, text: str) -> None:
    (tmp_path / "config.toml").write_text(text)
    with pytest.raises(ConfigError, match="specul"):
        load_config(tmp_path)


@pytest.mark.parametrize(("text", "rate"), [("", None), ("split_audit = 0\n", 0.0), ("split_audit = 0.25\n", 0.25),
                                            ("split_audit = 1\n", 1.0)])
def test_split_audit_key(tmp_path: Path, text: str, rate: float | None) -> None:
    (tmp_path / "config.toml").write_text(text)
    assert load_config(tmp_path).split_audit == rate


@pytest.mark.parametrize(("text", "cap"), [("", None), ("model_upload_limit_mb_s = 1\n", 1.0),
                                           ("model_upload_limit_mb_s = 12.5\n", 12.5)])
def test_model_upload_limit_key(tmp_path: Path, text: str, cap: float | None) -> None:
    (tmp_path / "config.toml").write_text(text)
    assert load_config(tmp_path).model_upload_limit_mb_s == cap


@pytest.mark.parametrize("text", ["model_upload_limit_mb_s = 0.5\n", "model_upload_limit_mb_s = -3\n",
                                  'model_upload_limit_mb_s = "fast"\n', "model_upload_limit_mb_s = true\n"])
def test_bad_model_upload_limit_is_refused_by_name(tmp_path: Path, text: str) -> None:
    (tmp_path / "config.toml").write_text(text)
    with pytest.raises(ConfigError, match="model_upload_limit_mb_s"):
        load_config(tmp_path)


@pytest.mark.parametrize("text", ["split_audit = 1.5\n", "split_audit = -0.1\n", 'split_audit = "often"\n',
                                  "split_audit = true\n"])
def test_bad_split_audit_is_refused_by_name(tmp_path: Path, text: str) -> None:
    (tmp_path / "config.toml").write_text(text)
    with pytest.raises(ConfigError, match="split_audit"):
        load_config(tmp_path)


def test_models_sections_give_recommended_sampling(tmp_path: Path) -> None:
    (tmp_path / "config.toml").write_text('[models.default]\ntemperature = 0.3\ntop_k = 40\nmin_p = 0.05\n'
                                          'repeat_penalty = 1.1\nmax_tokens = 256\nsystem_prompt = "Be brief."\n'
                                          '[models."Other.Q4_0"]\ntop_p = 0.5\n')
    models = load_config(tmp_path).models
    assert models["default"] == Recommended(temperature=0.3, top_k=40, min_p=0.05, repeat_penalty=1.1,
                                            max_tokens=256, system_prompt="Be brief.")
    assert models["Other.Q4_0"] == Recommended(top_p=0.5)


@pytest.mark.parametrize(("text", "name"), [
    ("[models.x]\ntemperature = 3\n", "temperature"), ("[models.x]\nmin_p = 1.5\n", "min_p"),
    ("[models.x]\nrepeat_penalty = 0\n", "repeat_penalty"), ("[models.x]\ntop_k = 1.5\n", "top_k"),
    ("[models.x]\nmax_tokens = 0\n", "max_tokens"), ('[models.x]\nsystem_prompt = ""\n', "system_prompt"),
    ("[models.x]\nseed = 1\n", "seed"), ("models = 1\n", "models"), ("[models]\nx = 1\n", "models.x"),
])
def test_bad_model_sections_are_refused_by_name(tmp_path: Path, text: str, name: str) -> None:
    (tmp_path / "config.toml").write_text(text)
    with pytest.raises(ConfigError, match=name):
        load_config(tmp_path)


LOCAL = "/ip4/127.0.0.1/tcp/4001/p2p/QmLocal"


def test_dht_bootstrap_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--dht-bootstrap, then $MESHLLM_DHT_BOOTSTRAP, then config.toml, then (for lookups) the default list."""
    monkeypatch.delenv(DHT_BOOTSTRAP_ENV, raising=False)
    assert dht_bootstrap((), Config(), default=True) == (list(DEFAULT_DHT_BOOTSTRAP), "the default bootstrap list")
    assert dht_bootstrap((), Config(), default=False) == ([], "nothing set")  # never the public list unasked
    (tmp_path / "config.toml").write_text(f'dht_bootstrap = ["{LOCAL}"]\n')
    assert dht_bootstrap((), load_config(tmp_path), default=True)[0] == [LOCAL]
    (tmp_path / "config.toml").write_text("dht_bootstrap = []\n")  # explicitly none: no default either
    assert dht_bootstrap((), load_config(tmp_path), default=True) == ([], "dht_bootstrap in config.toml")
    monkeypatch.setenv(DHT_BOOTSTRAP_ENV, f"{LOCAL}, {LOCAL}2")
    assert dht_bootstrap((), load_config(tmp_path), default=True)[0] == [LOCAL, LOCAL + "2"]
    monkeypatch.setenv(DHT_BOOTSTRAP_ENV, "none")
    assert dht_bootstrap((), Config(), default=True) == ([], "$MESHLLM_DHT_BOOTSTRAP")
    assert dht_bootstrap(("/ip4/10.0.0.1/tcp/1/p2p/Qm",), Config(), default=True)[1] == "--dht-bootstrap"


def test_the_default_list_is_well_formed() -> None:
    from meshllm.cli.common import dht_multiaddrs

    assert dht_multiaddrs(None, None, DEFAULT_DHT_BOOTSTRAP) == DEFAULT_DHT_BOOTSTRAP  # type: ignore[arg-type]


def test_threads_writing_one_private_file_at_once_all_succeed(tmp_path: Path) -> None:
    """Two peers asking one node for the same manifest wrote it from two threads: each rename must
    move its own temporary file (CI once saw one thread rename the other's away: FileNotFoundError)."""
    path = tmp_path / "shared.bin"
    payloads = [bytes([i]) * 4096 for i in range(16)]
    with ThreadPoolExecutor(max_workers=16) as pool:
        list(pool.map(lambda data: write_private(path, data), payloads))
    assert path.read_bytes() in payloads
    assert path.stat().st_mode & 0o777 == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["shared.bin"], "a temporary file was left behind"


def test_create_private_keeps_the_first_writer(tmp_path: Path) -> None:
    path = tmp_path / "key"
    with ThreadPoolExecutor(max_workers=8) as pool:
        won = list(pool.map(lambda i: create_private(path, b"%d" % i), range(8)))
    assert won.count(True) == 1
    assert path.read_bytes() == b"%d" % won.index(True)
    assert [p.name for p in tmp_path.iterdir()] == ["key"]
