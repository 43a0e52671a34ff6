"""Device discovery through ggml's registry, and the placement decisions built on it (CPU build here).

No accelerator is lent to this machine: the registry lists only the CPU, so these tests pin down the
CPU-only behaviour and drive the accelerator decisions (which device, how many layers) with device
descriptions of the kind a GPU build's registry returns.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as Q
from stage_helpers import PROMPT
from tinymodels import write_tiny_llama

from meshllm.engine import capacity
from meshllm.engine.ggml import lib
from meshllm.engine.ggml.backends import Backends, Device, choose_accelerator, devices, layers_that_fit
from meshllm.engine.ggml.stage import StageModel

GB = 1 << 30


def _gpu(name: str, free: int, kind: str = "gpu") -> Device:
    return Device(name=name, description=f"{name} test device", kind=kind, memory_free=free,  # type: ignore[arg-type]
                  memory_total=2 * free)


def test_registry_lists_the_cpu_with_its_memory() -> None:
    devs = devices()
    cpu = [d for d in devs if d.kind == "cpu"]
    assert len(cpu) == 1 and cpu[0].name == "CPU" and cpu[0].memory_total > 0 and cpu[0].handle
    assert choose_accelerator(devs) is None  # llama-cpp-python here is a CPU build
    assert capacity.measure_capacity().vram_bytes == 0


def test_the_gpu_with_most_free_memory_is_chosen() -> None:
    cpu = Device(name="CPU", description="cpu", kind="cpu", memory_free=64 * GB, memory_total=64 * GB)
    assert choose_accelerator([cpu]) is None
    chosen = choose_accelerator([cpu, _gpu("CUDA0", 8 * GB), _gpu("CUDA1", 20 * GB), _gpu("iGPU", 40 * GB, "igpu")])
    assert chosen is not None and chosen.name == "CUDA1"  # discrete before integrated, then free memory
    assert choose_accelerator([cpu, _gpu("iGPU", 40 * GB, "igpu")]).name == "iGPU"  # type: ignore[union-attr]


def test_layers_that_fit() -> None:
    assert layers_that_fit(10 * GB, GB, 32, fixed_bytes=GB, reserve_bytes=0) == 9
    assert layers_that_fit(100 * GB, GB, 32) == 32
    assert layers_that_fit(GB // 2, GB, 32) == 0


def test_llama_cpp_offload_default(tiny_llama: Path) -> None:
    """All layers (-1) when the model fits, as many as fit otherwise, none without an accelerator."""
    assert capacity.llama_gpu_layers(tiny_llama, None, None) == 0
    assert capacity.llama_gpu_layers(tiny_llama, 3, None) == 0
    assert capacity.llama_gpu_layers(tiny_llama, None, _gpu("CUDA0", 8 * GB)) == -1
    assert capacity.llama_gpu_layers(tiny_llama, 1, _gpu("CUDA0", 8 * GB)) == 1
    per_layer = tiny_llama.stat().st_size // 5  # 4 blocks + embeddings/head
    free = 256 * (1 << 20) + 3 * per_layer  # the margin, the head and two layers
    assert capacity.llama_gpu_layers(tiny_llama, None, _gpu("CUDA0", free)) == 2


def test_cpu_backend_threads_and_repacking(tmp_path: Path) -> None:
    """Weights go where llama.cpp puts them: with fast kernels Q4_0 matrices into CPU_REPACK, the rest in
    place; with the default exact kernels every weight is used in place from the map."""
    path = write_tiny_llama(tmp_path / "q4.gguf", weight_type=Q.Q4_0)
    b = Backends(threads=2, repack=True)
    try:
        assert b.threads == 2 and b.backends == [b.cpu] and b.gpu is None
        assert "CPU_REPACK" in [b.buft_name(x) for x in b.cpu_extra_bufts]
    finally:
        b.close()
    exact = StageModel.load(path, threads=1)
    try:
        assert set(exact.weights.placement.values()) == {"CPU"} and exact.weights.copied_bytes == 0
    finally:
        exact.close()
    stage = StageModel.load(path, threads=1, kernels="fast")
    try:
        placement = stage.weights.placement
        assert placement["blk.0.attn_q.weight"] == "CPU_REPACK" and placement["blk.0.attn_norm.weight"] == "CPU"
        assert placement["token_embd.weight"] == "CPU"  # looked up by rows: never repacked
        assert stage.weights.copied_bytes > 0 and stage.weights.mapped_bytes > 0 and stage.gpu_layers == 0
        one = stage.forward("a", np.array(PROMPT), 0)
    finally:
        stage.close()
    two_threads = StageModel.load(path, threads=2, kernels="fast")
    try:
        assert np.array_equal(two_threads.forward("a", np.array(PROMPT), 0), one)  # threads split work, not sums
    finally:
        two_threads.close()


def test_library_is_llama_cpp_pythons() -> None:
    g = lib.load()
    assert g.version in lib.SUPPORTED_VERSIONS and g.lib_dir.name == "lib" and g.lib_dir.parent.name == "llama_cpp"
