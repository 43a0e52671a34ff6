"""Compute devices through ggml's backend registry: the CPU always, an accelerator when there is one.

Nothing here names CUDA, Metal, Vulkan or ROCm. ggml's registry lists the devices of whatever backends
llama-cpp-python was built with (a CUDA build registers its GPUs there, a CPU build only the CPU), each
with a type, a name and its free and total memory. A stage asks the registry which device to use,
puts its weights and KV cache on it, and runs its graphs through a scheduler over [device, CPU], which
sends any op the device cannot run to the CPU. A CPU-only build takes exactly the same path with one
backend, so the code that would drive a GPU is the code every test runs.

Weights are placed the way llama.cpp places them (``select_weight_buft``): for each weight, the first
buffer type in the device's list whose device says it can run the op that uses the weight. On the CPU
that list starts with the CPU backend's "extra" buffer types, among them ``CPU_REPACK``, which stores
some quantized matrices (Q4_0, Q4_K, IQ4_NL on AVX2) interleaved for faster kernels. Those extra
types are used only with ``repack`` (``--kernels fast``): the node's default, row-exact kernels keep
weights in their file layout, as the llama.cpp engine then does (``meshllm.engine.kernels``); either
way, matching llama.cpp's choice is what makes our logits bit-identical to its own.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from meshllm.engine.base import default_threads
from meshllm.engine.ggml import lib
from meshllm.engine.ggml.errors import UnsupportedModel
from meshllm.engine.ggml.graph import Graph, T

DeviceKind = Literal["cpu", "gpu", "igpu", "accel"]
_KINDS: dict[int, DeviceKind] = {lib.DEV_CPU: "cpu", lib.DEV_GPU: "gpu", lib.DEV_IGPU: "igpu", lib.DEV_ACCEL: "accel"}
WeightOp = Literal["matmul", "matmul_id", "rows", "mul", "add", "rope"]
"""How a weight is used: matrix product, product with experts chosen per token (a stack of expert
matrices), row lookup (embeddings), norm scale, bias, rope factors."""


@dataclass(frozen=True)
class Device:
    """One device of ggml's registry."""

    name: str
    """ggml's device name (``CPU``, ``CUDA0``, ``Metal``, ``Vulkan0``...)."""
    description: str
    kind: DeviceKind
    memory_free: int
    """Bytes free now (for the CPU: the system's available memory)."""
    memory_total: int
    handle: int = field(default=0, repr=False, compare=False)

    @property
    def accelerator(self) -> bool:
        """A GPU (discrete or integrated): where weights, KV and compute should go."""
        return self.kind in ("gpu", "igpu")


def devices() -> list[Device]:
    """Every device ggml's registry knows, in registry order (loads and checks ggml first)."""
    g = lib.load()
    out = []
    for i in range(g.ggml_backend_dev_count()):
        dev = g.ggml_backend_dev_get(i)
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        g.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        kind = _KINDS.get(g.ggml_backend_dev_type(dev))
        if kind is None:  # a meta device (several GPUs as one); its members are listed on their own
            continue
        out.append(Device(
            name=(g.ggml_backend_dev_name(dev) or b"?").decode(),
            description=(g.ggml_backend_dev_description(dev) or b"").decode(),
            kind=kind, memory_free=int(free.value), memory_total=int(total.value), handle=int(dev),
        ))
    return out


def choose_accelerator(devs: Sequence[Device]) -> Device | None:
    """The accelerator to compute on: the GPU with the most free memory (discrete before integrated)."""
    accel = [d for d in devs if d.accelerator]
    if not accel:
        return None
    return max(accel, key=lambda d: (d.kind == "gpu", d.memory_free))


def layers_that_fit(free_bytes: int, layer_bytes: int, n_layers: int, fixed_bytes: int = 0,
                    reserve_bytes: int = 256 << 20) -> int:
    """How many of ``n_layers`` layers of ``layer_bytes`` fit in ``free_bytes`` after ``fixed_bytes``.

    ``reserve_bytes`` is left free for compute buffers and the driver (llama.cpp's fitting leaves a
    similar margin). Used for the default of ``--gpu-layers``: offload all layers that fit.
    """
    room = free_bytes - reserve_bytes - fixed_bytes
    if layer_bytes <= 0:
        return n_layers if room >= 0 else 0
    return max(0, min(n_layers, room // layer_bytes))


class Backends:
    """The backends one stage computes on: an optional accelerator, then the CPU (the scheduler wants it last)."""

    def __init__(self, threads: int | None = None, accelerator: Device | None = None, *, repack: bool = False) -> None:
        """``repack``: also offer the CPU's extra buffer types (repacked weights, ``--kernels fast``)."""
        g = self.g = lib.load()
        devs = devices()
        cpu = next((d for d in devs if d.kind == "cpu"), None)
        if cpu is None:
            raise UnsupportedModel("ggml's registry has no CPU device", hint="reinstall llama-cpp-python")
        self.cpu_device = cpu
        self.accelerator = accelerator
        self.cpu = g.ggml_backend_dev_init(cpu.handle, None)
        if not self.cpu:
            raise UnsupportedModel("ggml could not start its CPU backend")
        self.gpu = g.ggml_backend_dev_init(accelerator.handle, None) if accelerator is not None else None
        if accelerator is not None and not self.gpu:
            g.ggml_backend_free(self.cpu)
            raise UnsupportedModel(f"ggml could not start a backend on {accelerator.name}")
        self.threads = threads or default_threads()
        reg = g.ggml_backend_dev_backend_reg(cpu.handle)
        setter = g.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_set_n_threads")
        if setter:
            lib.SetThreads(setter)(self.cpu, self.threads)
        self.cpu_buft = g.ggml_backend_dev_buffer_type(cpu.handle)
        self.cpu_extra_bufts = self._extra_bufts(reg, cpu.handle) if repack else []
        self.gpu_buft = g.ggml_backend_dev_buffer_type(accelerator.handle) if accelerator is not None else None

    def _extra_bufts(self, reg: int, dev: int) -> list[int]:
        """The CPU device's extra buffer types (repack and the like), as llama.cpp lists them."""
        fn = self.g.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_dev_get_extra_bufts")
        if not fn:
            return []
        arr = lib.ExtraBufts(fn)(dev)
        out = []
        i = 0
        while arr and arr[i]:
            out.append(int(arr[i]))
            i += 1
        return out

    @property
    def backends(self) -> list[int]:
        """Backend handles for the scheduler, the CPU last."""
        return [b for b in (self.gpu, self.cpu) if b]

    def buft_name(self, buft: int) -> str:
        return (self.g.ggml_backend_buft_name(buft) or b"?").decode()

    def allocate(self, buft: int, tensors: list[T], usage: int = 0) -> int:
        """One buffer of type ``buft`` holding ``tensors`` (which have no data yet), zeroed; returns it.

        Offsets follow the buffer type's alignment and allocation sizes (a repacked matrix may need
        more than its file bytes). The caller frees the buffer with ``ggml_backend_buffer_free``.
        """
        g = self.g
        align = max(1, int(g.ggml_backend_buft_get_alignment(buft)))
        offsets, size = [], 0
        for t in tensors:
            offsets.append(size)
            size += -(-int(g.ggml_backend_buft_get_alloc_size(buft, t.p)) // align) * align
        buf = g.ggml_backend_buft_alloc_buffer(buft, max(size, align))
        if not buf:
            raise UnsupportedModel(f"could not allocate {size / 2**20:.1f} MiB of {self.buft_name(buft)} memory",
                                   hint="offload fewer layers (--gpu-layers), or give this node fewer layers")
        g.ggml_backend_buffer_clear(buf, 0)
        if usage:
            g.ggml_backend_buffer_set_usage(buf, usage)
        base = int(g.ggml_backend_buffer_get_base(buf))
        for t, off in zip(tensors, offsets, strict=True):
            status = g.ggml_backend_tensor_alloc(buf, t.p, ctypes.c_void_p(base + off))
            if status != lib.STATUS_SUCCESS:
                g.ggml_backend_buffer_free(buf)
                raise UnsupportedModel(f"ggml refused to place a tensor in {self.buft_name(buft)} memory ({status})")
        return int(buf)

    def weight_buffer_type(self, weight: T, op: WeightOp, on_accelerator: bool) -> int:
        """The buffer type a weight goes in: the first in the device's list that runs ``op`` on it.

        ``weight`` is a tensor without data; the op is built in a scratch context and a dummy buffer of
        each candidate type is attached to the weight for the question, as llama.cpp does.
        """
        candidates: list[tuple[int, int]] = []
        if on_accelerator and self.accelerator is not None and self.gpu_buft:
            candidates.append((self.accelerator.handle, self.gpu_buft))
        candidates += [(self.cpu_device.handle, b) for b in self.cpu_extra_bufts]
        candidates.append((self.cpu_device.handle, self.cpu_buft))
        scratch = Graph(self.g, max_tensors=8)
        try:
            probe = self._op_on(scratch, weight, op)
            for dev, buft in candidates:
                if self._supports(dev, buft, weight, probe):
                    return buft
        finally:
            scratch.close()
        return self.cpu_buft

    def _op_on(self, graph: Graph, w: T, op: WeightOp) -> T:
        """The op a weight is used in, with a 512-token batch (llama.cpp's probe size)."""
        g, ne = graph, w.ne
        if op == "matmul":
            return g.mul_mat(w, g.new(lib.F32, ne[0], 512, ne[2], ne[3]))
        if op == "matmul_id":
            return g.mul_mat_id(w, g.new(lib.F32, ne[0], 1, 512), g.new(lib.I32, 1, 512))
        if op == "rows":
            return g.get_rows(w, g.new(lib.I32, 512))
        if op == "rope":
            x = g.new(lib.F32, 2 * ne[0], 1, 512)
            return g.rope(x, g.new(lib.I32, 512), w, n_dims=2 * ne[0], mode=0, n_ctx_orig=0, freq_base=1e4,
                          freq_scale=1.0, ext_factor=0.0, attn_factor=1.0, beta_fast=0.0, beta_slow=0.0)
        a = g.new(lib.F32, *ne)
        return g.mul(a, w) if op == "mul" else g.add(a, w)

    def _supports(self, dev: int, buft: int, w: T, probe: T) -> bool:
        g = self.g
        dummy = g.ggml_backend_buft_alloc_buffer(buft, 0)
        if not dummy:
            return False
        w.p.contents.buffer = dummy
        try:
            return bool(g.ggml_backend_dev_supports_op(dev, probe.p))
        finally:
            w.p.contents.buffer = None
            g.ggml_backend_buffer_free(dummy)

    def close(self) -> None:
        for b in (self.gpu, self.cpu):
            if b:
                self.g.ggml_backend_free(b)
        self.gpu = self.cpu = None
