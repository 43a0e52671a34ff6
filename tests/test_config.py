"""``config.toml``: defaults, the ``speculate`` key, and clear errors for bad settings."""

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
