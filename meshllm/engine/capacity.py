"""What this machine offers the mesh: memory (RAM and accelerator), cores and a measured compute speed.

The speed is measured (a short float32 matrix product), not read from a datasheet: the planner
compares nodes by what they actually deliver under their current load. Accelerators come from
ggml's backend registry (:mod:`meshllm.engine.ggml.backends`): a CUDA, Metal, Vulkan or ROCm build of
llama-cpp-python lists its GPUs there with their free memory, a CPU build lists none, so
``vram_bytes`` is 0 and everything behaves as on a CPU-only node.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import numpy as np

from meshllm.engine.ggml.backends import Device, choose_accelerator, devices, layers_that_fit
from meshllm.errors import MeshllmError
from meshllm.mesh.records import Capacity
from meshllm.models.metadata import read_metadata

log = logging.getLogger(__name__)

BENCH_N = 256
BENCH_REPEATS = 5


def total_ram_bytes() -> int:
    """Physical memory in bytes (0 when the platform does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def measure_gflops(n: int = BENCH_N, repeats: int = BENCH_REPEATS) -> float:
    """Best-of-``repeats`` float32 ``n x n`` matmul speed in GFLOP/s (about 10 ms in all)."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return round(2 * n**3 / max(best, 1e-9) / 1e9, 2)


MEASURE_LAYERS = 2
"""Blocks of the model :func:`measure_layer_seconds` loads and times."""
MEASURE_STEPS = 8


def measure_layer_seconds(path: Path, layers: int = MEASURE_LAYERS, steps: int = MEASURE_STEPS) -> float:
    """Seconds one block of the model at ``path`` takes for one decode step on this machine's CPU.

    The first ``layers`` blocks are loaded with the ggml stage runtime (the split runtime, with the
    node's default threads and kernels) and decoded ``steps`` times; the best step counts, as in
    :func:`measure_gflops` (another process taking the cores only ever makes a step slower). Decode
    is bound by memory bandwidth, not by matmul speed, so this is what a chain's compute costs; a
    GFLOP/s figure predicted the default model 10-20x too slow (issue 29). Raises :class:`MeshllmError`
    when the runtime cannot load the model."""
    from meshllm.engine.ggml import StageModel
    from meshllm.engine.ggml.hparams import read_hparams
    from meshllm.models.gguf_file import GGUFFile

    n_layers = read_hparams(GGUFFile(path)).n_layers
    stage = StageModel.load(path, 0, min(layers, n_layers), max_context=steps + 1, gpu_layers=0)
    try:
        best = float("inf")
        for step in range(steps):
            start = time.perf_counter()
            stage.forward("measure", np.array([step + 1], dtype=np.int64), step, last_only=True)
            best = min(best, time.perf_counter() - start)
    finally:
        stage.close()
    return best / min(layers, n_layers)


def release_freed_memory() -> None:
    """Hand memory freed by an unloaded model back to the system (glibc's ``malloc_trim``).

    llama.cpp frees a model's and context's buffers on close, but glibc keeps freed heap in its arenas
    for reuse: measured on the default model, 20 load/unload cycles left the process at 264-269 MB
    (a plateau from the third cycle, not a leak), and ``malloc_trim(0)`` took it back to 85 MB. Other
    C libraries (or none found) leave it as it is.
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    if trim is not None:
        trim(0)


def compute_devices() -> list[Device]:
    """ggml's devices, or an empty list when its libraries cannot be checked (reported, never fatal)."""
    try:
        return devices()
    except MeshllmError as exc:
        log.warning("no device list from ggml: %s", exc)
        return []


def accelerator() -> Device | None:
    """The accelerator models and stages would use, if llama-cpp-python has one."""
    return choose_accelerator(compute_devices())


def measure_capacity() -> Capacity:
    """This machine's capacity for its peer record; ``vram_bytes`` is the accelerator's free memory."""
    accel = accelerator()
    return Capacity(ram_bytes=total_ram_bytes(), vram_bytes=accel.memory_free if accel else 0,
                    cpu_cores=os.cpu_count() or 1, gflops=measure_gflops())


def llama_gpu_layers(path: Path, requested: int | None, accel: Device | None) -> int:
    """``n_gpu_layers`` for llama.cpp: ``requested`` (``-1`` all), else every layer that fits ``accel``.

    Without an accelerator it is 0 whatever was asked (a CPU build ignores it anyway). A layer is
    priced at the file's size over its blocks (llama.cpp runs architectures our header reader does
    not know, so this uses only the generic metadata); all layers fitting means the output layer too.
    """
    if accel is None:
        return 0
    if requested is not None:
        return requested
    meta = read_metadata(path)
    blocks = max(1, meta.block_count)
    per_layer = meta.file_size // (blocks + 1)  # the embeddings and head count as one more block
    fit = layers_that_fit(accel.memory_free, per_layer, blocks, fixed_bytes=per_layer)
    return -1 if fit >= blocks else fit
