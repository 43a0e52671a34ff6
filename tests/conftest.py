"""Test tiers: every test that starts a process is marked ``integration``.

``pytest -m "not integration and not slow"`` is the inner loop (in-process tests only); plain
``pytest`` runs everything. Marking by hand would go stale, so the mark is derived: a test is
``integration`` when its function, or a fixture it uses (directly or through other fixtures), can
reach the ``subprocess`` module or ``asyncio.create_subprocess_*``: through the helpers of
``tests/nodes.py`` (``NodeProcess``, ``meshllm``, ``running_nodes``), a helper of its own module or
of another test helper module (``tests/wan/emulator.py``, ``tests/lan.py``), followed by name
through functions, classes and their methods that live under ``tests/``.
"""

from __future__ import annotations

import compileall
import inspect
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest

import meshllm
from meshllm.engine.kernels import use_kernels

# No test may reach the default DHT bootstrap list (public peers): lookups find nothing unless a test
# points MESHLLM_DHT_BOOTSTRAP (or --dht-bootstrap) at a DHT it started on 127.0.0.1. Node processes
# inherit it.
os.environ["MESHLLM_DHT_BOOTSTRAP"] = "none"

# ggml reads its tiled-matmul switch once per process, at the first matmul, and llama.cpp references
# that tests build directly (``llama_cpp.Llama``) run one before any engine would set it: whichever
# test ran first decided whether every later engine in the process was row-exact. Tests run on the
# node's default kernels, as every node does (its engines choose before they load).
use_kernels("exact")

TESTS = Path(__file__).resolve().parent


def pytest_configure(config: pytest.Config) -> None:
    """Under ``PYTHONDONTWRITEBYTECODE`` no process writes bytecode, so each of the suite's hundreds of
    ``python -m meshllm`` processes compiled meshllm's ~200 modules again (a quarter of a node's start-up
    CPU). Reading bytecode is still allowed: compile the package under test once (only what changed),
    into its usual ``__pycache__`` folders (git ignores them)."""
    if sys.flags.dont_write_bytecode and "PYTEST_XDIST_WORKER" not in os.environ:  # once, before the workers
        compileall.compile_dir(Path(meshllm.__file__).parent, quiet=1)


MAX_WORKERS = 4
"""Most test worker processes (pyproject's ``-n auto``): each worker's tests start nodes of their own,
and the tests' deadlines assume a worker has about a core."""


def usable_cores() -> int:
    """Cores this process may run on: its CPU affinity, less what a cgroup v2 CPU quota allows (a
    container can see every core of its host and be allowed two)."""
    cores = len(os.sched_getaffinity(0))
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        if quota != "max":
            cores = min(cores, max(1, int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return cores


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: one worker per usable core, at most :data:`MAX_WORKERS`. A worker runs whole files
    (``--dist loadfile``), so a module's fixtures (a cluster of nodes, a loaded model) are built once."""
    return min(usable_cores(), MAX_WORKERS)


SPAWN_ATTRS = frozenset({"create_subprocess_exec", "create_subprocess_shell"})
"""Attribute names whose use starts a process whatever module they are read from."""

_memo: dict[int, bool] = {}


def _ours(obj: Any) -> bool:
    """Whether ``obj`` is a function or class defined in a file under ``tests/``."""
    try:
        path = inspect.getsourcefile(obj)
    except TypeError:
        return False
    return path is not None and Path(path).resolve().is_relative_to(TESTS)


def _codes(code: types.CodeType) -> list[types.CodeType]:
    """``code`` and every code object nested in it (inner functions, lambdas, comprehensions)."""
    out = [code]
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            out.extend(_codes(const))
    return out


def spawns(obj: Any) -> bool:
    """Whether calling ``obj`` (a test, fixture, helper function or class) can start a process."""
    obj = inspect.unwrap(obj)
    key = id(obj)
    if key in _memo:
        return _memo[key]
    _memo[key] = False  # a cycle (mutual recursion) adds nothing
    found = False
    if inspect.isclass(obj):
        found = any(spawns(member) for member in vars(obj).values()
                    if inspect.isfunction(member) or isinstance(member, (staticmethod, classmethod, property)))
    elif isinstance(obj, (staticmethod, classmethod)):
        found = spawns(obj.__func__)
    elif isinstance(obj, property):
        found = any(spawns(f) for f in (obj.fget, obj.fset) if f is not None)
    elif inspect.isfunction(obj):
        names = {n for c in _codes(obj.__code__) for n in c.co_names}
        if names & SPAWN_ATTRS:
            found = True
        else:
            for name in names:
                target = obj.__globals__.get(name)
                if target is subprocess or (
                        (inspect.isfunction(target) or inspect.isclass(target)) and _ours(target) and spawns(target)):
                    found = True
                    break
    _memo[key] = found
    return found


def _fixture_funcs(item: pytest.Item) -> list[Any]:
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return []
    return [defs[-1].func for name in item.fixturenames for defs in [info.name2fixturedefs.get(name)] if defs]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        func = getattr(item, "function", None)
        if func is None:
            continue
        if spawns(func) or any(_ours(f) and spawns(f) for f in _fixture_funcs(item)):
            item.add_marker(pytest.mark.integration)
