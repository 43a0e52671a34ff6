"""Tiny GGUF models with random weights, written in milliseconds, that llama.cpp loads and runs.

Every writer is deterministic in its seed. The vocabulary is the one FACTS.md describes: tokenizer
model ``llama`` with 259 tokens (``<unk>``, ``<s>``, ``</s>``, then the 256 byte tokens), so any text
tokenizes (as bytes) and llama-cpp-python can serve the model. Weights are float32 (``ALL_F32``)
unless a test asks for another tensor type.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import gguf
import gguf.quants
import numpy as np

VOCAB = 259
BOS, EOS, UNK = 1, 2, 0


def _add_vocab(w: gguf.GGUFWriter) -> None:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * VOCAB)
    w.add_token_types([2, 3, 3] + [6] * 256)
    w.add_bos_token_id(BOS)
    w.add_eos_token_id(EOS)
    w.add_unk_token_id(UNK)


def _matrix(rng: np.random.Generator, out: int, inp: int, scale: float | None = None) -> np.ndarray:
    """A random [out, in] numpy matrix (a GGUF [in, out] tensor), scaled like a trained layer."""
    s = scale if scale is not None else 1.0 / np.sqrt(inp)
    return (rng.standard_normal((out, inp)) * s).astype(np.float32)


def _norm(rng: np.random.Generator, n: int, center: float = 1.0) -> np.ndarray:
    return (center + 0.1 * rng.standard_normal(n)).astype(np.float32)


def write_tiny_llama(
    path: str | Path,
    *,
    seed: int = 0,
    n_layers: int = 2,
    width: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    ffn: int = 128,
    arch: str = "llama",
    context: int = 2048,
    rope_scaling: dict[str, object] | None = None,
    rope_freqs: bool = False,
    weight_type: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32,
    metadata: dict[str, float | int | str] | None = None,
) -> Path:
    """Write a llama-style model (``arch`` llama or qwen2; qwen2 gets q/k/v biases) and return its path.

    ``metadata`` adds keys as they are (floats as float32, ints as uint32), e.g.
    ``{"general.sampling.temp": 0.0}``.

    ``rope_scaling`` adds ``<arch>.rope.scaling.*`` keys, e.g. ``{"type": "linear", "factor": 2.0}``;
    ``rope_freqs`` adds llama 3's per-dimension rope frequency factors. ``weight_type`` quantizes the
    matrices (embeddings, projections, head) with the ``gguf`` package (Q4_0, Q5_0, Q8_0...).
    """
    path = Path(path)
    rng = np.random.default_rng(seed)
    head_dim = width // heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    w.add_context_length(context)
    w.add_embedding_length(width)
    w.add_block_count(n_layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(head_dim)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    extra = {f"{arch}.rope.scaling.{key}": value for key, value in (rope_scaling or {}).items()}
    for full, value in {**extra, **(metadata or {})}.items():
        if isinstance(value, str):
            w.add_string(full, value)
        elif isinstance(value, int):
            w.add_uint32(full, value)
        else:
            w.add_float32(full, float(value))
    _add_vocab(w)

    def matrix(name: str, array: np.ndarray) -> None:
        if weight_type == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, array)
        else:
            w.add_tensor(name, gguf.quants.quantize(array, weight_type), raw_dtype=weight_type)

    matrix("token_embd.weight", (rng.standard_normal((VOCAB, width)) * 0.5).astype(np.float32))
    if rope_freqs:
        w.add_tensor("rope_freqs.weight", np.linspace(1.0, 8.0, head_dim // 2).astype(np.float32))
    for il in range(n_layers):
        p = f"blk.{il}."
        w.add_tensor(p + "attn_norm.weight", _norm(rng, width))
        matrix(p + "attn_q.weight", _matrix(rng, heads * head_dim, width))
        matrix(p + "attn_k.weight", _matrix(rng, kv_heads * head_dim, width))
        matrix(p + "attn_v.weight", _matrix(rng, kv_heads * head_dim, width))
        if arch == "qwen2":
            w.add_tensor(p + "attn_q.bias", (0.1 * rng.standard_normal(heads * head_dim)).astype(np.float32))
            w.add_tensor(p + "attn_k.bias", (0.1 * rng.standard_normal(kv_heads * head_dim)).astype(np.float32))
            w.add_tensor(p + "attn_v.bias", (0.1 * rng.standard_normal(kv_heads * head_dim)).astype(np.float32))
        matrix(p + "attn_output.weight", _matrix(rng, width, heads * head_dim))
        w.add_tensor(p + "ffn_norm.weight", _norm(rng, width))
        matrix(p + "ffn_gate.weight", _matrix(rng, ffn, width))
        matrix(p + "ffn_up.weight", _matrix(rng, ffn, width))
        matrix(p + "ffn_down.weight", _matrix(rng, width, ffn))
    w.add_tensor("output_norm.weight", _norm(rng, width))
    matrix("output.weight", _matrix(rng, VOCAB, width, scale=2.0 / np.sqrt(width)))
    _finish(w)
    return path


def write_tiny_gemma3(
    path: str | Path,
    *,
    seed: int = 0,
    n_layers: int = 7,
    width: int = 64,
    heads: int = 4,
    kv_heads: int = 1,
    head_dim: int = 32,
    ffn: int = 128,
    sliding_window: int = 8,
    softcap: float | None = None,
) -> Path:
    """Write a Gemma 3 model with tied embeddings and return its path.

    Seven layers with the default pattern give local layers 0-4 and 6 and global layer 5; the small
    window makes sliding-window masking matter within a short prompt. ``softcap`` adds final logit
    soft-capping, which Gemma 3 itself does not use.
    """
    path = Path(path)
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_name("tiny-gemma3")
    w.add_context_length(2048)
    w.add_embedding_length(width)
    w.add_block_count(n_layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1_000_000.0)
    w.add_sliding_window(sliding_window)
    if softcap is not None:
        w.add_final_logit_softcapping(softcap)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    _add_vocab(w)
    w.add_tensor("token_embd.weight", (rng.standard_normal((VOCAB, width)) / np.sqrt(width)).astype(np.float32))
    for il in range(n_layers):
        p = f"blk.{il}."
        w.add_tensor(p + "attn_norm.weight", _norm(rng, width))
        w.add_tensor(p + "attn_q.weight", _matrix(rng, heads * head_dim, width))
        w.add_tensor(p + "attn_k.weight", _matrix(rng, kv_heads * head_dim, width))
        w.add_tensor(p + "attn_v.weight", _matrix(rng, kv_heads * head_dim, width))
        w.add_tensor(p + "attn_q_norm.weight", _norm(rng, head_dim))
        w.add_tensor(p + "attn_k_norm.weight", _norm(rng, head_dim))
        w.add_tensor(p + "attn_output.weight", _matrix(rng, width, heads * head_dim))
        w.add_tensor(p + "post_attention_norm.weight", _norm(rng, width, 0.5))
        w.add_tensor(p + "ffn_norm.weight", _norm(rng, width))
        w.add_tensor(p + "ffn_gate.weight", _matrix(rng, ffn, width))
        w.add_tensor(p + "ffn_up.weight", _matrix(rng, ffn, width))
        w.add_tensor(p + "ffn_down.weight", _matrix(rng, width, ffn))
        w.add_tensor(p + "post_ffw_norm.weight", _norm(rng, width, 0.5))
    w.add_tensor("output_norm.weight", _norm(rng, width))
    _finish(w)
    return path


def write_tiny_gguf(
    path: str | Path, arch: str, tensors: dict[str, np.ndarray], *, raw_types: dict[str, int] | None = None
) -> Path:
    """Write a GGUF with llama-like metadata for ``arch`` and the given tensors (for refusal tests).

    ``raw_types`` maps a tensor name to a ``GGMLQuantizationType``; its array is then taken as the
    tensor's raw bytes in that type.
    """
    path = Path(path)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(256)
    w.add_embedding_length(64)
    w.add_block_count(1)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    _add_vocab(w)
    for name, array in tensors.items():
        raw = (raw_types or {}).get(name)
        w.add_tensor(name, array, raw_dtype=gguf.GGMLQuantizationType(raw) if raw is not None else None)
    _finish(w)
    return path


def _finish(w: gguf.GGUFWriter) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# ---- a tiny chat model that follows its template: deterministic replies and tool calls ----------

TOOL_MODEL_TEMPLATE = (
    "{%- set nl = '\n' -%}"
    "{%- set ns = namespace(system='') -%}"
    "{%- for m in messages if m.role == 'system' -%}{%- set ns.system = ns.system + m.content + nl -%}{%- endfor -%}"
    "{%- if tools -%}"
    "{%- set ns.system = ns.system + 'You may call functions. Signatures:' + nl + '<tools>' + nl -%}"
    "{%- for t in tools -%}{%- set ns.system = ns.system + (t | tojson) + nl -%}{%- endfor -%}"
    "{%- set ns.system = ns.system + '</tools>' + nl + 'Call one as <tool_call>{...}</tool_call>.' + nl -%}"
    "{%- endif -%}"
    "{%- if ns.system -%}{{ '<|im_start|>system' + nl + ns.system + '<|im_end|>' + nl }}{%- endif -%}"
    "{%- for m in messages if m.role != 'system' -%}"
    "{%- if m.role == 'tool' -%}"
    "{{ '<|im_start|>user' + nl + '<tool_response>' + nl + m.content + nl + '</tool_response><|im_end|>' + nl }}"
    "{%- elif m.role == 'assistant' -%}"
    "{{ '<|im_start|>assistant' + nl + (m.content or '') }}"
    "{%- for c in m.tool_calls or [] -%}"
    "{{ '<tool_call>' + nl + '{\"name\": \"' + c.function.name + '\", \"arguments\": ' }}"
    "{{ c.function.arguments | tojson }}{{ '}' + nl + '</tool_call>' }}"
    "{%- endfor -%}{{ '<|im_end|>' + nl }}"
    "{%- else -%}"
    "{{ '<|im_start|>' + m.role + nl + m.content + '<|im_end|>' + nl }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant' + nl }}{%- endif -%}"
)
"""A Hermes-style chat template (ChatML turns, tools listed in ``<tools>``, ``<tool_call>`` calls,
``<tool_response>`` results), written for these tests."""

TOOL_MODEL = "tiny-tools"
"""The model id the tests give the tool model (its file name without ``.gguf``)."""
TOOL_CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
"""What the tool model answers when the prompt lists tools and holds no tool result yet."""
TOOL_MODEL_REPLY = "OK"
"""What it answers otherwise (no tools, or after a tool result)."""
_CALL_PIECES = ("<tool_call>\n", '{"name": "get_weather",', ' "arguments":', ' {"city": "Paris"}', "}\n</tool_call>")
"""The call's tokens (llama-cpp-python detokenizes pieces of at most 32 bytes)."""


def write_tiny_tool_model(path: str | Path, blocks: int = 1, repeat_calls: bool = False) -> Path:
    """A llama-architecture model whose replies are fixed by construction, not by luck.

    Its layers compute: *next token = a fixed successor of the current one* (one-hot embeddings,
    an output matrix that maps each token to its successor with a margin of ~38 logits, so even
    temperature 1 is deterministic), except after the newline that ends the generation prompt,
    where one SwiGLU neuron decides between ``OK`` and a call of ``get_weather``. The neuron reads
    two flags that the attention layer (uniform attention: queries and keys are zero) averages over
    the prompt: "the ``<tools>`` token appeared" and "a ``<tool_response>`` token appeared". So the
    model calls the tool when tools are listed and no result came back yet, and says ``OK``
    otherwise, which is exactly what a tool round trip needs. Lower-case letters cycle (``a`` ->
    ``b`` ... ``z`` -> ``a``), so plain completions produce text; most other tokens end the turn.
    Under a grammar that forbids the successor, the model prefers ``"``, then ``}``, then ``]``,
    so constrained JSON closes quickly instead of running to ``max_tokens``.

    ``blocks`` above 1 appends blocks whose attention output and FFN down matrices are zero: each
    passes the residual on unchanged, so the logits are the same and the model can be split.

    ``repeat_calls``: a call is followed by a newline instead of the end of the turn, after which
    the model decides again, and calls again: the small model that repeats its call until
    ``max_tokens`` (where a grammar allows more calls).
    """
    path = Path(path)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    im_end, tools_tok, response_tok = len(tokens) + 1, len(tokens) + 2, len(tokens) + 3
    tokens += ["<|im_start|>", "<|im_end|>", "<tools>", "<tool_response>"]
    types += [3, 3, 4, 4]
    calls = list(range(len(tokens), len(tokens) + len(_CALL_PIECES)))
    tokens += list(_CALL_PIECES)
    types += [4] * len(_CALL_PIECES)
    vocab = len(tokens)
    byte = {b: 3 + b for b in range(256)}

    succ = {t: im_end for t in range(vocab)}
    for c in range(26):
        succ[byte[ord("a") + c]] = byte[ord("a") + (c + 1) % 26]
    succ[byte[ord("\n")]] = byte[ord("O")]
    succ[byte[ord("O")]] = byte[ord("K")]
    for a, b in itertools.pairwise(calls):
        succ[a] = b
    if repeat_calls:
        succ[calls[-1]] = byte[ord("\n")]

    width, heads, ffn = 320, 4, 32
    bias, flag_tools, flag_response, decide = vocab, vocab + 1, vocab + 2, vocab + 3
    assert decide < width
    s = np.sqrt(width / 2)  # a normalised one-hot-plus-bias embedding has s in both places
    embd = np.zeros((vocab, width), np.float32)
    embd[np.arange(vocab), np.arange(vocab)] = 1.0
    embd[:, bias] = 1.0

    zeros = np.zeros((width, width), np.float32)
    wv = np.zeros((width, width), np.float32)
    wv[0, tools_tok] = 1.0 / s  # head 0, value dim 0: "tools listed"; dim 1: "a tool result came back"
    wv[1, response_tok] = 1.0 / s
    wo = np.zeros((width, width), np.float32)
    wo[flag_tools, 0] = 1.0
    wo[flag_response, 1] = 1.0

    newline = byte[ord("\n")]
    gate = np.zeros((ffn, width), np.float32)
    gate[0, flag_tools] = 1e5
    gate[0, flag_response] = -1e7
    gate[0, newline] = 1e3  # (x[newline] - x[bias]) is 0 at a newline and -s elsewhere: the neuron is off
    gate[0, bias] = -1e3
    up = np.zeros((ffn, width), np.float32)
    up[0, bias] = 1.0
    down = np.zeros((width, ffn), np.float32)
    down[decide, 0] = 1.0

    out = np.zeros((vocab, width), np.float32)
    out[[succ[t] for t in range(vocab)], np.arange(vocab)] = 3.0
    out[calls[0], decide] = 2.0
    for char, weight in (('"', 1.0), ("}", 0.9), ("]", 0.8)):  # under a grammar that forbids the successor,
        out[byte[ord(char)], bias] = weight                      # close strings, then objects, then arrays

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-tools")
    w.add_context_length(8192)
    w.add_embedding_length(width)
    w.add_block_count(blocks)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(heads)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(width // heads)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * vocab)
    w.add_token_types(types)
    w.add_bos_token_id(BOS)
    w.add_eos_token_id(im_end)
    w.add_unk_token_id(UNK)
    w.add_add_space_prefix(False)
    w.add_chat_template(TOOL_MODEL_TEMPLATE)
    w.add_tensor("token_embd.weight", embd)
    w.add_tensor("blk.0.attn_norm.weight", np.ones(width, np.float32))
    w.add_tensor("blk.0.attn_q.weight", zeros)
    w.add_tensor("blk.0.attn_k.weight", zeros)
    w.add_tensor("blk.0.attn_v.weight", wv)
    w.add_tensor("blk.0.attn_output.weight", wo)
    w.add_tensor("blk.0.ffn_norm.weight", np.ones(width, np.float32))
    w.add_tensor("blk.0.ffn_gate.weight", gate)
    w.add_tensor("blk.0.ffn_up.weight", up)
    w.add_tensor("blk.0.ffn_down.weight", down)
    for il in range(1, blocks):  # identity blocks: nothing reaches the residual
        for name, tensor in (("attn_norm", np.ones(width, np.float32)), ("attn_q", zeros), ("attn_k", zeros),
                             ("attn_v", zeros), ("attn_output", zeros), ("ffn_norm", np.ones(width, np.float32)),
                             ("ffn_gate", np.zeros((ffn, width), np.float32)),
                             ("ffn_up", np.zeros((ffn, width), np.float32)),
                             ("ffn_down", np.zeros((width, ffn), np.float32))):
            w.add_tensor(f"blk.{il}.{name}.weight", tensor)
    w.add_tensor("output_norm.weight", np.ones(width, np.float32))
    w.add_tensor("output.weight", out)
    _finish(w)
    return path
