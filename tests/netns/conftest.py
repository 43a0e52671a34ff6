"""Fixtures for the network namespace tests: the lab (built once per module) and a tiny model."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from netns_lab import NatLab, missing_requirements
from tinymodels import write_tiny_llama


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    reason = missing_requirements()
    for item in items:
        if "netns" in item.keywords and reason is not None:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="module")
def lab() -> Iterator[NatLab]:
    """Relay on the public segment; ``a`` and ``b`` behind endpoint-independent NATs, ``s`` behind a symmetric one."""
    built = NatLab(f"ml{os.getpid() % 100000}")
    try:
        yield built.build({"a": "eim", "b": "eim", "s": "symmetric"})
    finally:
        built.destroy()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama.gguf", seed=0)
