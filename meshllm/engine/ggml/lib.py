"""Typed ctypes bindings for the part of ggml this runtime uses, from llama-cpp-python's own libraries.

llama-cpp-python ships ggml as shared libraries (``llama_cpp/lib/libggml-base.so``, ``libggml.so``
and the backends) with the whole C API exported. Binding those files, not a second build, keeps one
ggml in the process: the backend registry, its devices and the CPU backend's thread pool are the ones
llama.cpp itself uses.

ggml aborts the process on a failed assert, so nothing here is called blindly: :func:`load` refuses a
ggml version this runtime was not checked against and verifies the ``ggml_tensor`` layout (its size
and where ``type``, ``ne``, ``nb``, ``name`` and ``data`` sit) before any model is touched; the graph
builder (:mod:`meshllm.engine.ggml.graph`) checks shapes and types before each op.
"""

from __future__ import annotations

import ctypes
import threading
from ctypes import POINTER, c_bool, c_char, c_char_p, c_float, c_int, c_int32, c_int64, c_size_t, c_void_p
from pathlib import Path
from typing import Any

from meshllm.engine.ggml.errors import UnsupportedModel

SUPPORTED_VERSIONS = ("0.25.3",)
"""ggml versions whose API and struct layout this module was written and tested against."""
OBJECT_SIZE = 32
"""``sizeof(struct ggml_object)``: ``ggml_tensor_overhead()`` is the tensor struct plus this."""
MAX_DIMS = 4
MAX_NAME = 64

# enum ggml_type (the values this runtime uses or names)
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1 = 0, 1, 2, 3, 6, 7, 8, 9
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K = 10, 11, 12, 13, 14, 15
IQ4_NL, I32, I64, BF16, MXFP4 = 20, 26, 27, 30, 39

ROPE_NORMAL, ROPE_NEOX = 0, 2
PREC_F32 = 10
STATUS_SUCCESS = 0

# enum ggml_backend_dev_type
DEV_CPU, DEV_GPU, DEV_IGPU, DEV_ACCEL = 0, 1, 2, 3
BUFFER_USAGE_WEIGHTS = 1


class Tensor(ctypes.Structure):
    """``struct ggml_tensor`` (ggml.h); the layout is verified against the library at load time."""

    _fields_ = [
        ("type", c_int),
        ("buffer", c_void_p),
        ("ne", c_int64 * MAX_DIMS),
        ("nb", c_size_t * MAX_DIMS),
        ("op", c_int),
        ("op_params", c_int32 * 16),
        ("flags", c_int32),
        ("src", c_void_p * 10),
        ("view_src", c_void_p),
        ("view_offs", c_size_t),
        ("data", c_void_p),
        ("name", c_char * MAX_NAME),
        ("extra", c_void_p),
        ("padding", c_char * 8),
    ]


TensorP = POINTER(Tensor)


class InitParams(ctypes.Structure):
    """``struct ggml_init_params``."""

    _fields_ = [("mem_size", c_size_t), ("mem_buffer", c_void_p), ("no_alloc", c_bool)]


_P = c_void_p  # opaque handles: context, graph, backend, buffer, buffer type, device, registry, scheduler
_T = TensorP
_I64 = c_int64
_F = c_float

# name: (restype, argtypes). Only what the runtime calls; each is looked up in libggml-base, then libggml.
_PROTOTYPES: dict[str, tuple[Any, list[Any]]] = {
    "ggml_version": (c_char_p, []),
    "ggml_commit": (c_char_p, []),
    "ggml_tensor_overhead": (c_size_t, []),
    "ggml_graph_overhead_custom": (c_size_t, [c_size_t, c_bool]),
    "ggml_init": (_P, [InitParams]),
    "ggml_free": (None, [_P]),
    "ggml_type_name": (c_char_p, [c_int]),
    "ggml_row_size": (c_size_t, [c_int, _I64]),
    "ggml_nbytes": (c_size_t, [_T]),
    "ggml_is_contiguous": (c_bool, [_T]),
    "ggml_new_tensor": (_T, [_P, c_int, c_int, POINTER(_I64)]),
    "ggml_set_name": (_T, [_T, c_char_p]),
    "ggml_set_input": (None, [_T]),
    "ggml_set_output": (None, [_T]),
    "ggml_get_rows": (_T, [_P, _T, _T]),
    "ggml_mul_mat": (_T, [_P, _T, _T]),
    "ggml_mul_mat_id": (_T, [_P, _T, _T, _T]),
    "ggml_argsort_top_k": (_T, [_P, _T, c_int]),
    "ggml_soft_max": (_T, [_P, _T]),
    "ggml_sigmoid": (_T, [_P, _T]),
    "ggml_silu": (_T, [_P, _T]),
    "ggml_sum_rows": (_T, [_P, _T]),
    "ggml_clamp": (_T, [_P, _T, _F, _F]),
    "ggml_div": (_T, [_P, _T, _T]),
    "ggml_cont": (_T, [_P, _T]),
    "ggml_add_id": (_T, [_P, _T, _T, _T]),
    "ggml_swiglu_oai": (_T, [_P, _T, _T, _F, _F]),
    "ggml_soft_max_add_sinks": (None, [_T, _T]),
    "ggml_flash_attn_ext_add_sinks": (None, [_T, _T]),
    "ggml_prec_set_acc": (c_bool, [_T, c_int]),
    "ggml_add": (_T, [_P, _T, _T]),
    "ggml_mul": (_T, [_P, _T, _T]),
    "ggml_scale": (_T, [_P, _T, _F]),
    "ggml_tanh": (_T, [_P, _T]),
    "ggml_rms_norm": (_T, [_P, _T, _F]),
    "ggml_rope_ext": (_T, [_P, _T, _T, _T, c_int, c_int, c_int, _F, _F, _F, _F, _F, _F]),
    "ggml_rope_set_offset": (_T, [_T, c_int]),
    "ggml_repeat_4d": (_T, [_P, _T, _I64, _I64, _I64, _I64]),
    "ggml_reshape_2d": (_T, [_P, _T, _I64, _I64]),
    "ggml_reshape_3d": (_T, [_P, _T, _I64, _I64, _I64]),
    "ggml_reshape_4d": (_T, [_P, _T, _I64, _I64, _I64, _I64]),
    "ggml_fill": (_T, [_P, _T, _F]),
    "ggml_view_2d": (_T, [_P, _T, _I64, _I64, c_size_t, c_size_t]),
    "ggml_view_3d": (_T, [_P, _T, _I64, _I64, _I64, c_size_t, c_size_t, c_size_t]),
    "ggml_permute": (_T, [_P, _T, c_int, c_int, c_int, c_int]),
    "ggml_transpose": (_T, [_P, _T]),
    "ggml_cont_2d": (_T, [_P, _T, _I64, _I64]),
    "ggml_concat": (_T, [_P, _T, _T, c_int]),
    "ggml_set_rows": (_T, [_P, _T, _T, _T]),
    "ggml_soft_max_ext": (_T, [_P, _T, _T, _F, _F]),
    "ggml_flash_attn_ext": (_T, [_P, _T, _T, _T, _T, _F, _F, _F]),
    "ggml_geglu_split": (_T, [_P, _T, _T]),
    "ggml_swiglu_split": (_T, [_P, _T, _T]),
    "ggml_swiglu": (_T, [_P, _T]),
    "ggml_new_graph_custom": (_P, [_P, c_size_t, c_bool]),
    "ggml_build_forward_expand": (None, [_P, _T]),
    # buffers and tensors in them
    "ggml_backend_buft_name": (c_char_p, [_P]),
    "ggml_backend_buft_alloc_buffer": (_P, [_P, c_size_t]),
    "ggml_backend_buft_get_alignment": (c_size_t, [_P]),
    "ggml_backend_buft_get_alloc_size": (c_size_t, [_P, _T]),
    "ggml_backend_buffer_free": (None, [_P]),
    "ggml_backend_buffer_get_size": (c_size_t, [_P]),
    "ggml_backend_buffer_get_base": (c_void_p, [_P]),
    "ggml_backend_buffer_clear": (None, [_P, ctypes.c_uint8]),
    "ggml_backend_buffer_set_usage": (None, [_P, c_int]),
    "ggml_backend_cpu_buffer_from_ptr": (_P, [c_void_p, c_size_t]),
    "ggml_backend_tensor_alloc": (c_int, [_P, _T, c_void_p]),
    "ggml_backend_tensor_set": (None, [_T, c_void_p, c_size_t, c_size_t]),
    "ggml_backend_tensor_get": (None, [_T, c_void_p, c_size_t, c_size_t]),
    # backends, devices and the registry
    "ggml_backend_free": (None, [_P]),
    "ggml_backend_reg_count": (c_size_t, []),
    "ggml_backend_reg_get_proc_address": (c_void_p, [_P, c_char_p]),
    "ggml_backend_load_all_from_path": (None, [c_char_p]),
    "ggml_backend_dev_count": (c_size_t, []),
    "ggml_backend_dev_get": (_P, [c_size_t]),
    "ggml_backend_dev_name": (c_char_p, [_P]),
    "ggml_backend_dev_description": (c_char_p, [_P]),
    "ggml_backend_dev_memory": (None, [_P, POINTER(c_size_t), POINTER(c_size_t)]),
    "ggml_backend_dev_type": (c_int, [_P]),
    "ggml_backend_dev_backend_reg": (_P, [_P]),
    "ggml_backend_dev_init": (_P, [_P, c_char_p]),
    "ggml_backend_dev_buffer_type": (_P, [_P]),
    "ggml_backend_dev_supports_op": (c_bool, [_P, _T]),
    # the scheduler: one graph over several backends, unsupported ops falling back to the CPU
    "ggml_backend_sched_new": (_P, [POINTER(_P), POINTER(_P), c_int, c_size_t, c_bool, c_bool]),
    "ggml_backend_sched_free": (None, [_P]),
    "ggml_backend_sched_alloc_graph": (c_bool, [_P, _P]),
    "ggml_backend_sched_graph_compute": (c_int, [_P, _P]),
    "ggml_backend_sched_get_buffer_size": (c_size_t, [_P, _P]),
}

SetThreads = ctypes.CFUNCTYPE(None, c_void_p, c_int)
"""``ggml_backend_set_n_threads_t``, found through a registry's ``get_proc_address``."""
ExtraBufts = ctypes.CFUNCTYPE(POINTER(c_void_p), c_void_p)
"""``ggml_backend_dev_get_extra_bufts_t``: a NULL-terminated list of a device's extra buffer types."""


class Ggml:
    """The loaded libraries; every function of ``_PROTOTYPES`` is an attribute with its types set."""

    def __init__(self, libs: list[ctypes.CDLL], lib_dir: Path) -> None:
        self.lib_dir = lib_dir
        for name, (restype, argtypes) in _PROTOTYPES.items():
            fn = None
            for lib in libs:
                try:
                    fn = getattr(lib, name)
                    break
                except AttributeError:
                    continue
            if fn is None:
                raise UnsupportedModel(f"the ggml library in {lib_dir} lacks {name}")
            fn.restype, fn.argtypes = restype, argtypes
            setattr(self, name, fn)
        self.version = self.ggml_version().decode()
        self.commit = self.ggml_commit().decode()

    def __getattr__(self, name: str) -> Any:  # the bound functions are set in __init__; this types them as Any
        raise AttributeError(name)


def library_dir() -> Path:
    """llama-cpp-python's folder of shared libraries (``llama_cpp/lib``).

    Importing llama_cpp loads libllama and with it the ggml libraries, and installs its log callback
    for ggml; that callback prints everything until told otherwise, so ggml's info and debug lines
    (one per repacked tensor) are silenced here as ``Llama(verbose=False)`` would.
    """
    import llama_cpp
    from llama_cpp._logger import set_verbose

    set_verbose(False)
    return Path(llama_cpp.__file__).parent / "lib"


def _find(lib_dir: Path, stem: str) -> Path:
    for suffix in (".so", ".dylib", ".dll"):
        path = lib_dir / f"{stem}{suffix}"
        if path.exists():
            return path
    raise UnsupportedModel(f"no {stem} library in {lib_dir}", hint="reinstall llama-cpp-python (see install.sh)")


def check_layout(g: Ggml) -> None:
    """Refuse a ggml whose ``struct ggml_tensor`` is not the one :class:`Tensor` describes.

    The size must match ``ggml_tensor_overhead()``, and a probe tensor made by ggml itself must read
    back with the type, shape, strides, name and data pointer ggml gave it.
    """
    overhead = g.ggml_tensor_overhead()
    if overhead != ctypes.sizeof(Tensor) + OBJECT_SIZE:
        raise UnsupportedModel(
            f"ggml {g.version}: tensor struct is {overhead - OBJECT_SIZE} bytes, these bindings expect "
            f"{ctypes.sizeof(Tensor)}", hint="install the llama-cpp-python version in pyproject.toml",
        )
    ctx = g.ggml_init(InitParams(overhead * 2 + 256, None, False))
    if not ctx:
        raise UnsupportedModel("ggml_init failed while checking the tensor layout")
    try:
        ne = (c_int64 * 2)(3, 5)
        t = g.ggml_new_tensor(ctx, F16, 2, ne)
        g.ggml_set_name(t, b"layout-probe")
        c = t.contents
        expected = (F16, (3, 5, 1, 1), (2, 6, 30, 30), b"layout-probe")
        got = (c.type, tuple(c.ne), tuple(c.nb), c.name)
        if got != expected or not c.data or g.ggml_nbytes(t) != 30:
            raise UnsupportedModel(f"ggml {g.version}: tensor fields read back as {got}, expected {expected}")
    finally:
        g.ggml_free(ctx)
    names = {Q4_K: b"q4_K", Q8_0: b"q8_0", BF16: b"bf16", F16: b"f16", I64: b"i64", MXFP4: b"mxfp4"}
    for type_id, name in names.items():
        if g.ggml_type_name(type_id) != name:
            raise UnsupportedModel(f"ggml {g.version}: type {type_id} is {g.ggml_type_name(type_id)!r}, not {name!r}")


_lock = threading.Lock()
_bound: Ggml | None = None


def _bind() -> Ggml:
    """Load and bind the libraries once; on a build with dynamically loaded backends, load those too."""
    global _bound
    with _lock:
        if _bound is None:
            lib_dir = library_dir()
            mode = getattr(ctypes, "RTLD_GLOBAL", 0)
            libs = [ctypes.CDLL(str(_find(lib_dir, stem)), mode=mode) for stem in ("libggml-base", "libggml")]
            g = Ggml(libs, lib_dir)
            if g.ggml_backend_reg_count() == 0:  # GGML_BACKEND_DL: the backends are separate files
                g.ggml_backend_load_all_from_path(str(lib_dir).encode())
            _bound = g
        return _bound


def check_version(g: Ggml) -> None:
    """Refuse a ggml version not in :data:`SUPPORTED_VERSIONS` (its enums or signatures may differ)."""
    if g.version not in SUPPORTED_VERSIONS:
        raise UnsupportedModel(
            f"ggml {g.version} (commit {g.commit}) is not a version this runtime was checked against "
            f"({', '.join(SUPPORTED_VERSIONS)})",
            hint="install the llama-cpp-python version pinned in pyproject.toml",
        )


def load() -> Ggml:
    """The process's ggml, after checking its version and tensor layout.

    Raises :class:`UnsupportedModel` on a mismatch; callers run this before mapping or computing
    anything, so an incompatible llama-cpp-python is a clear refusal instead of a crash.
    """
    g = _bind()
    check_version(g)
    check_layout(g)
    return g
