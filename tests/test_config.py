"""``config.toml``: defaults, the ``speculate`` and ``split_audit`` keys, and clear errors for bad settings."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshllm.config import Config, load_config
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


@pytest.mark.parametrize("text", ["split_audit = 1.5\n", "split_audit = -0.1\n", 'split_audit = "often"\n',
                                  "split_audit = true\n"])
def test_bad_split_audit_is_refused_by_name(tmp_path: Path, text: str) -> None:
    (tmp_path / "config.toml").write_text(text)
    with pytest.raises(ConfigError, match="split_audit"):
        load_config(tmp_path)
