"""llama.cpp through llama-cpp-python's low-level ctypes bindings: the only module that calls them.

A failed llama.cpp assertion aborts the whole process, and a C++ exception escaping its C API does
the same, so every value is checked here before it crosses: token ids against the vocabulary,
sequence ids and positions against the context, row counts against the batch, grammar text
(:mod:`meshllm.engine.gbnf`) before llama.cpp parses it, and a grammar's acceptance of a token
before the token is fed to it.

The context is built for slots: ``n_seq`` sequences, each in its own KV stream (``kv_unified``
off) of ``n_ctx_seq`` cells, so a sequence attends only to its own cells, laid out in position
order. That keeps each sequence's arithmetic independent of the others in the batch (see
docs/llama-engine.md, "Same request, same answer"). Flash attention is the caller's choice: the
engine measures which attention kernel computes a multi-row window of one sequence exactly as
single rows (docs/llama-engine.md, "Speculative decoding").
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Sequence
from pathlib import Path

import llama_cpp as L
import numpy as np

from meshllm.engine.base import EngineError, InvalidRequest
from meshllm.engine.gbnf import BadGrammar, check_grammar

TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])
"""``llama_token_data`` as a numpy record (checked against ctypes at import)."""
assert TOKEN_DATA.itemsize == ctypes.sizeof(L.llama_token_data)

log = logging.getLogger(__name__)
_backend_lock = threading.Lock()
_backend_ready = False
_GGML_LOG_WARN, _GGML_LOG_ERROR = 3, 4  # ggml.h: NONE, DEBUG, INFO, WARN, ERROR, CONT


@L.llama_log_callback
def _forward_log(level: int, text: bytes, _user: ctypes.c_void_p) -> None:
    """llama.cpp's log into ours: errors as errors, warnings at debug level, the chatter not at all."""
    if level in (_GGML_LOG_WARN, _GGML_LOG_ERROR):
        log.log(logging.ERROR if level == _GGML_LOG_ERROR else logging.DEBUG, "llama.cpp: %s",
                text.decode("utf-8", "replace").rstrip())


def _init_backend() -> None:
    global _backend_ready
    with _backend_lock:
        if not _backend_ready:
            L.llama_log_set(_forward_log, ctypes.c_void_p(0))
            L.llama_backend_init()
            _backend_ready = True


def longest_token(vocab: ctypes.c_void_p | int) -> int:
    """Most bytes any one token of ``vocab`` stands for in a prompt, read from its stored text (which
    spells a space or a byte in more bytes than it stands for, so this bounds from above). A prompt of
    ``n`` bytes has at least ``n / longest_token`` tokens (:func:`meshllm.engine.text.tokenize_bounded`)."""
    get = L.llama_vocab_get_text
    return max((len(get(vocab, t) or b"") for t in range(int(L.llama_vocab_n_tokens(vocab)))), default=1) or 1


class NativeModel:
    """Weights and vocabulary of one GGUF."""

    def __init__(self, path: Path, *, n_gpu_layers: int = 0, repack: bool = True, vocab_only: bool = False) -> None:
        """``repack=False`` keeps quantized weights in their file layout: no repacked matrix kernels,
        whose 1-3 row and 4-row forms accumulate differently (row-exact batching needs that).
        ``vocab_only`` reads the metadata and vocabulary alone (no tensors, well under a second): what
        a grammar needs, and it works on a stage file, which carries the model's metadata verbatim."""
        _init_backend()
        params = L.llama_model_default_params()
        params.n_gpu_layers = n_gpu_layers
        params.use_extra_bufts = repack
        params.vocab_only = vocab_only
        ptr = L.llama_model_load_from_file(str(path).encode(), params)
        if not ptr:
            raise EngineError(f"llama.cpp could not load {path}",
                              hint="check that the file is a complete GGUF this llama.cpp supports")
        self.ptr = ptr
        self.vocab = L.llama_model_get_vocab(ptr)
        self.n_vocab = int(L.llama_vocab_n_tokens(self.vocab))
        self.n_ctx_train = int(L.llama_model_n_ctx_train(ptr))
        self.bos = int(L.llama_vocab_bos(self.vocab))
        self.eos = int(L.llama_vocab_eos(self.vocab))
        self.longest_token = longest_token(self.vocab)
        self._pieces: dict[int, bytes] = {}
        self._eog: dict[int, bool] = {}

    def check_tokens(self, tokens: Sequence[int], what: str) -> None:
        """Refuse token ids outside the vocabulary (:class:`InvalidRequest`) before any reaches llama.cpp."""
        if not tokens:
            return
        ids = np.asarray(tokens, dtype=np.int64)
        bad = (ids < 0) | (ids >= self.n_vocab)
        if bad.any():
            raise InvalidRequest(f"{what} holds token id {int(ids[bad][0])}, outside this model's "
                                 f"vocabulary of {self.n_vocab} tokens")

    def tokenize(self, text: bytes, *, add_special: bool, parse_special: bool) -> list[int]:
        """``text`` as token ids (``add_special``: BOS/EOS as the model wants them)."""
        size = len(text) + 16
        while True:
            buf = (L.llama_token * size)()
            n = L.llama_tokenize(self.vocab, text, len(text), buf, size, add_special, parse_special)
            if n >= 0:
                return list(buf[:n])
            if -n <= size:
                raise EngineError(f"llama.cpp could not tokenize the text ({n})")
            size = -n

    def piece(self, token: int) -> bytes:
        """The bytes of one token as generated text (special tokens render as nothing)."""
        cached = self._pieces.get(token)
        if cached is not None:
            return cached
        self.check_tokens((token,), "a generated token")
        size = 64
        while True:
            buf = ctypes.create_string_buffer(size)
            n = L.llama_token_to_piece(self.vocab, token, buf, size, 0, False)
            if n >= 0:
                self._pieces[token] = out = buf.raw[:n]
                return out
            size = -n

    def token_text(self, token: int) -> str:
        """The vocabulary's text for ``token`` (a chat template's BOS/EOS strings)."""
        self.check_tokens((token,), "a special token")
        return bytes(L.llama_vocab_get_text(self.vocab, token)).decode("utf-8", "replace")

    def is_eog(self, token: int) -> bool:
        """Whether ``token`` ends generation (EOS, EOT and the model's other end markers)."""
        known = self._eog.get(token)
        if known is None:
            self.check_tokens((token,), "a generated token")
            self._eog[token] = known = bool(L.llama_vocab_is_eog(self.vocab, token))
        return known

    def close(self) -> None:
        if self.ptr:
            L.llama_model_free(self.ptr)
            self.ptr = None


class NativeContext:
    """A llama.cpp context of ``n_seq`` independent sequences and the one batch every call uses."""

    def __init__(self, model: NativeModel, *, n_seq: int, n_ctx_seq: int, n_batch: int, threads: int,
                 flash_attn: bool = False) -> None:
        if not (1 <= n_seq <= int(L.llama_max_parallel_sequences())):
            raise EngineError(f"{n_seq} sequences is outside llama.cpp's 1-{L.llama_max_parallel_sequences()}")
        params = L.llama_context_default_params()
        params.n_ctx = n_seq * n_ctx_seq
        params.n_batch = params.n_ubatch = n_batch  # one call is one ubatch: its row count is ours
        params.n_seq_max = n_seq
        params.n_threads = params.n_threads_batch = threads
        params.kv_unified = False
        params.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else L.LLAMA_FLASH_ATTN_TYPE_DISABLED
        params.no_perf = True
        ptr = L.llama_init_from_model(model.ptr, params)
        if not ptr:
            raise EngineError(f"llama.cpp could not create a context of {n_seq} x {n_ctx_seq} tokens",
                              hint="lower --parallel or the context size")
        self.ptr = ptr
        self.model = model
        self.n_seq = n_seq
        self.n_ctx_seq = int(L.llama_n_ctx_seq(ptr))
        self.n_batch = n_batch
        self.flash_attn = flash_attn
        self._mem = L.llama_get_memory(ptr)
        self._batch = L.llama_batch_init(n_batch, 0, 1)
        b = self._batch
        self._token = np.ctypeslib.as_array(b.token, shape=(n_batch,))
        self._pos = np.ctypeslib.as_array(b.pos, shape=(n_batch,))
        self._n_seq_id = np.ctypeslib.as_array(b.n_seq_id, shape=(n_batch,))
        self._logits = np.ctypeslib.as_array(b.logits, shape=(n_batch,))
        self._seq_id = [b.seq_id[i] for i in range(n_batch)]
        self._n_seq_id[:] = 1

    def decode(self, tokens: Sequence[int], positions: Sequence[int], seqs: Sequence[int],
               outputs: Sequence[bool]) -> None:
        """Run one batch: row ``i`` is ``tokens[i]`` at ``positions[i]`` of sequence ``seqs[i]``.

        Logits are kept for rows with ``outputs[i]``; read them with :meth:`logits` before the next call.
        """
        n = len(tokens)
        if not (0 < n <= self.n_batch) or not (len(positions) == len(seqs) == len(outputs) == n):
            raise EngineError(f"bad batch of {n} rows (capacity {self.n_batch})")
        self.model.check_tokens(tokens, "the batch")
        pos = np.asarray(positions, dtype=np.int64)
        seq = np.asarray(seqs, dtype=np.int64)
        if pos.min() < 0 or pos.max() >= self.n_ctx_seq or seq.min() < 0 or seq.max() >= self.n_seq:
            raise EngineError("batch position or sequence out of range")
        self._token[:n] = tokens
        self._pos[:n] = pos
        self._logits[:n] = np.asarray(outputs, dtype=np.int8)
        for i in range(n):
            self._seq_id[i][0] = seqs[i]
        self._batch.n_tokens = n
        rc = L.llama_decode(self.ptr, self._batch)
        if rc != 0:
            raise EngineError(f"llama_decode failed with status {rc}")

    def logits(self, row: int) -> np.ndarray:
        """The logits of batch row ``row`` of the last :meth:`decode` (a view, valid until the next call)."""
        ptr = L.llama_get_logits_ith(self.ptr, row)
        if not ptr:
            raise EngineError(f"llama.cpp kept no logits for row {row}")
        return np.ctypeslib.as_array(ptr, shape=(self.model.n_vocab,))

    def trim(self, seq: int, keep: int) -> None:
        """Forget sequence ``seq``'s cells from position ``keep`` on (``keep=0``: all of them)."""
        if not (0 <= seq < self.n_seq) or keep < 0:
            raise EngineError(f"cannot trim sequence {seq} to {keep}")
        if not L.llama_memory_seq_rm(self._mem, seq, keep, -1):
            L.llama_memory_seq_rm(self._mem, seq, -1, -1)  # partial removal refused: drop it all
            raise EngineError(f"llama.cpp could not trim sequence {seq} to {keep} tokens")

    def length(self, seq: int) -> int:
        """Cells sequence ``seq`` holds (its largest position + 1)."""
        if not (0 <= seq < self.n_seq):
            raise EngineError(f"no sequence {seq}")
        return int(L.llama_memory_seq_pos_max(self._mem, seq)) + 1

    def close(self) -> None:
        if self.ptr:
            L.llama_batch_free(self._batch)
            L.llama_free(self.ptr)
            self.ptr = None


class Candidates:
    """A ``llama_token_data_array`` over a numpy buffer of the whole vocabulary, reused every step."""

    def __init__(self, n_vocab: int) -> None:
        self.buf = np.zeros(n_vocab, dtype=TOKEN_DATA)
        self._ids = np.arange(n_vocab, dtype=np.int32)
        self.array = L.llama_token_data_array(
            data=self.buf.ctypes.data_as(ctypes.POINTER(L.llama_token_data)), size=n_vocab, selected=-1, sorted=False)

    def load(self, logits: np.ndarray) -> None:
        """Reset to every token with ``logits`` (samplers may have shrunk or re-pointed the array)."""
        self.buf["id"] = self._ids
        self.buf["logit"] = logits
        self.buf["p"] = 0.0
        self.array.data = self.buf.ctypes.data_as(ctypes.POINTER(L.llama_token_data))
        self.array.size = self.buf.size
        self.array.selected = -1
        self.array.sorted = False

    def current(self) -> tuple[np.ndarray, np.ndarray]:
        """Token ids and logits the samplers left (copies)."""
        n = int(self.array.size)
        view = np.ctypeslib.as_array(ctypes.cast(self.array.data, ctypes.POINTER(ctypes.c_uint8)),
                                     shape=(n * TOKEN_DATA.itemsize,)).view(TOKEN_DATA)
        return view["id"].copy(), view["logit"].copy()


class NativeSampler:
    """One llama.cpp sampler (a chain, or a grammar) owned by one slot."""

    def __init__(self, ptr: int | None, what: str) -> None:
        if not ptr:
            raise EngineError(f"llama.cpp could not create the {what} sampler")
        self.ptr = ptr

    @classmethod
    def chain(cls, model: NativeModel, *, presence: float, frequency: float, top_k: int, top_p: float,
              temperature: float | None, penalty_window: int, min_p: float = 0.0,
              repeat: float = 1.0) -> NativeSampler | None:
        """Penalties, top-k, top-p, min-p and temperature in llama.cpp's order (``None`` when all are off)."""
        for name, value in (("presence_penalty", presence), ("frequency_penalty", frequency), ("top_p", top_p),
                            ("min_p", min_p), ("repeat_penalty", repeat)):
            if not np.isfinite(value):
                raise InvalidRequest(f"{name} must be a finite number")
        if repeat <= 0.0:
            raise InvalidRequest("repeat_penalty must be positive")  # llama.cpp divides by it
        parts = []
        if presence or frequency or repeat != 1.0:
            parts.append(L.llama_sampler_init_penalties(model.n_vocab, penalty_window, repeat, frequency, presence))
        if 0 < top_k < model.n_vocab:
            parts.append(L.llama_sampler_init_top_k(top_k))
        if temperature is not None and 0.0 < top_p < 1.0:
            parts.append(L.llama_sampler_init_top_p(top_p, 1))
        if temperature is not None and 0.0 < min_p <= 1.0:
            parts.append(L.llama_sampler_init_min_p(min_p, 1))
        if temperature is not None:
            if not (np.isfinite(temperature) and temperature > 0):
                raise InvalidRequest("temperature must be a positive finite number for sampling")
            parts.append(L.llama_sampler_init_temp(temperature))
        if not parts:
            return None
        ptr = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
        sampler = cls(ptr, "sampling chain")
        for part in parts:
            if not part:
                sampler.close()
                raise EngineError("llama.cpp could not create a sampler")
            L.llama_sampler_chain_add(ptr, part)  # the chain owns (and frees) its parts
        return sampler

    @classmethod
    def grammar(cls, model: NativeModel, text: str) -> NativeSampler:
        """A GBNF grammar (start rule ``root``), checked before llama.cpp parses it."""
        ptr = L.llama_sampler_init_grammar(model.vocab, check_grammar(text), b"root")
        if not ptr:
            raise BadGrammar("llama.cpp refused the grammar (see the node's log for where; left recursion "
                             "and unsupported syntax are the usual causes)")
        return cls(ptr, "grammar")

    def apply(self, candidates: Candidates) -> None:
        L.llama_sampler_apply(self.ptr, ctypes.byref(candidates.array))

    def accept(self, token: int) -> None:
        """Record a token the slot generated (penalty history, grammar state)."""
        L.llama_sampler_accept(self.ptr, token)

    def allows(self, token: int) -> bool:
        """Whether this grammar lets ``token`` come next (without changing its state)."""
        one = (L.llama_token_data * 1)()
        one[0].id, one[0].logit, one[0].p = token, 0.0, 0.0
        array = L.llama_token_data_array(data=one, size=1, selected=-1, sorted=False)
        L.llama_sampler_apply(self.ptr, ctypes.byref(array))
        return bool(np.isfinite(one[0].logit))

    def close(self) -> None:
        if self.ptr:
            L.llama_sampler_free(self.ptr)
            self.ptr = None
