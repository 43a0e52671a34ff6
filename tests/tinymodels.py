"""Tiny GGUF models with random weights, written in milliseconds, that llama.cpp loads and runs.

Every writer is deterministic in its seed. The vocabulary is the smallest that llama.cpp serves: tokenizer
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


def _add_vocab(w: gguf.GGUFWriter, extra: tuple[str, ...] = ()) -> None:
    """The byte vocabulary, then ``extra`` control tokens (llama.cpp looks some up by text for some families)."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + list(extra)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * len(tokens))
    w.add_token_types([2, 3, 3] + [6] * 256 + [3] * len(extra))
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
    """The original tiny llama (``arch`` llama or qwen2; qwen2 gets q/k/v biases): :func:`write_tiny` with 2 layers."""
    return write_tiny(arch, path, seed=seed, n_layers=n_layers, width=width, heads=heads, kv_heads=kv_heads, ffn=ffn,
                      context=context, rope_scaling=rope_scaling, rope_freqs=rope_freqs, weight_type=weight_type.name,
                      metadata=metadata)


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
    """A Gemma 3 with tied embeddings: seven layers with the default pattern give local layers 0-4 and 6
    and global layer 5. ``softcap`` adds final logit soft-capping, which Gemma 3 itself does not use."""
    return write_tiny("gemma3", path, seed=seed, n_layers=n_layers, width=width, heads=heads, kv_heads=kv_heads,
                      head_dim=head_dim, ffn=ffn, sliding_window=sliding_window, final_softcap=softcap)


FAMILIES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "mistral3", "olmo2", "smollm3", "granite",
            "ernie4_5", "mixtral", "qwen2moe", "qwen3moe", "gpt-oss", "glm4moe", "ernie4_5-moe", "deepseek2",
            "deepseek2-mla")
"""The families :func:`write_tiny` writes, one per model family the ggml runtime supports (``mixtral`` is
the ``llama`` architecture with experts, ``deepseek2-mla`` the ``deepseek2`` architecture in the absorbed
layout current DeepSeek V3 / R1 / Kimi K2 conversions use)."""
MOE_FAMILIES = ("mixtral", "qwen2moe", "qwen3moe", "gpt-oss", "glm4moe", "ernie4_5-moe", "deepseek2",
                "deepseek2-mla")
_DEEPSEEK = {"nope": 16, "rot": 8, "v": 16, "q_lora": 32, "kv_lora": 32}
"""The tiny DeepSeek's latent attention: key heads of 16 + 8 rotary dimensions, value heads of 16, ranks 32."""

_ARCH = {"mixtral": "llama", "deepseek2-mla": "deepseek2"}
_GEMMA = ("gemma2", "gemma3")


def write_tiny(
    family: str,
    path: str | Path,
    *,
    seed: int = 0,
    n_layers: int = 4,
    width: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int | None = None,
    ffn: int = 128,
    n_expert: int = 4,
    n_expert_used: int = 2,
    sliding_window: int = 8,
    context: int = 2048,
    rope_scaling: dict[str, object] | None = None,
    rope_freqs: bool = False,
    final_softcap: float | None = None,
    weight_type: str = "F32",
    metadata: dict[str, float | int | str] | None = None,
) -> Path:
    """Write a random-weight model of ``family`` (one of :data:`FAMILIES`) and return its path.

    The metadata keys and tensor names are the ones llama.cpp's converter writes for the family, so
    llama.cpp loads the file. Sliding-window families get a window of ``sliding_window`` tokens (so
    it matters within a short prompt); MoE families ``n_expert`` experts of ``ffn`` hidden units,
    ``n_expert_used`` per token. ``weight_type`` is ``F32``, a type the ``gguf`` package quantizes to
    (``F16``, ``Q8_0``, ``Q4_0``, ``Q4_1``, ``Q5_0``...; ``MXFP4`` quantizes only the expert stacks,
    as gpt-oss files do), or a llama.cpp file type (``Q4_K_M``,
    ``Q6_K``...): the model is then written in f32 and quantized by llama.cpp itself, as real
    files are (K-quants need a width that is a multiple of 256, else llama.cpp falls back).
    ``rope_scaling`` adds ``<arch>.rope.scaling.*`` keys, e.g. ``{"type": "linear", "factor": 2.0}``;
    ``rope_freqs`` adds llama 3's per-dimension rope frequency factors; ``final_softcap`` final logit
    soft-capping (Gemma 2 always has it, with attention soft-capping). ``metadata`` adds keys as they
    are (floats as float32, ints as uint32), e.g. ``{"general.sampling.temp": 0.0}``.
    """
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r} (known: {', '.join(FAMILIES)})")
    path = Path(path)
    native = weight_type in ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "MXFP4")
    target = path if native else path.with_suffix(".f32.gguf")
    rng = np.random.default_rng(seed)
    arch = _ARCH.get(family, family)
    hd = head_dim or width // heads
    if arch == "deepseek2":  # non-absorbed: a KV head per head; absorbed: one latent KV head
        kv_heads = heads if family == "deepseek2" else 1
    q_width, kv_width = heads * hd, kv_heads * hd
    w = gguf.GGUFWriter(str(target), arch)
    w.add_name(f"tiny-{family}")
    w.add_context_length(context)
    w.add_embedding_length(width)
    w.add_block_count(n_layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    ds = _DEEPSEEK if arch == "deepseek2" else None
    mla = family == "deepseek2-mla"
    if ds is not None:  # keys wider than values; absorbed: the cache's widths, and the heads' before absorption
        if mla:
            w.add_key_length(ds["kv_lora"] + ds["rot"])
            w.add_value_length(ds["kv_lora"])
            w.add_key_length_mla(ds["nope"] + ds["rot"])
            w.add_value_length_mla(ds["v"])
        else:
            w.add_key_length(ds["nope"] + ds["rot"])
            w.add_value_length(ds["v"])
        w.add_rope_dimension_count(ds["rot"])
        w.add_q_lora_rank(ds["q_lora"])
        w.add_kv_lora_rank(ds["kv_lora"])
    else:
        w.add_key_length(hd)
        w.add_value_length(hd)
    if family not in ("glm4moe", "deepseek2", "deepseek2-mla"):
        w.add_rope_dimension_count(hd)
    w.add_layer_norm_rms_eps(1e-6 if family in _GEMMA else 1e-5)
    w.add_rope_freq_base(1_000_000.0 if family in ("qwen3", "qwen3moe", "mistral3", "gemma3") else 10000.0)
    if family in (*_GEMMA, "gpt-oss"):
        w.add_sliding_window(sliding_window)
    if family == "granite":  # Granite 3's multipliers (the 2B's values)
        w.add_float32(f"{arch}.embedding_scale", 12.0)
        w.add_float32(f"{arch}.residual_scale", 0.22)
        w.add_float32(f"{arch}.attention.scale", 0.015625)
        w.add_float32(f"{arch}.logit_scale", 8.0)
    if family == "gemma2":
        w.add_attn_logit_softcapping(50.0)
        final_softcap = final_softcap or 30.0
    if final_softcap is not None:
        w.add_final_logit_softcapping(final_softcap)
    extra_keys = {f"{arch}.rope.scaling.{key}": value for key, value in (rope_scaling or {}).items()}
    for full, value in {**extra_keys, **(metadata or {})}.items():
        if isinstance(value, str):
            w.add_string(full, value)
        elif isinstance(value, int):
            w.add_uint32(full, value)
        else:
            w.add_float32(full, float(value))
    moe = family in MOE_FAMILIES
    if moe:
        w.add_expert_count(n_expert)
        w.add_expert_used_count(n_expert_used)
        if family in ("qwen2moe", "qwen3moe", "gpt-oss", "glm4moe", "ernie4_5-moe", "deepseek2", "deepseek2-mla"):
            w.add_expert_feed_forward_length(ffn)
        if family == "ernie4_5-moe":  # layer 0 dense, then experts every layer, one shared expert
            w.add_expert_shared_count(1)
            w.add_uint32(f"{arch}.leading_dense_block_count", 1)
            w.add_uint32(f"{arch}.interleave_moe_layer_step", 1)
        if family in ("qwen2moe", "ernie4_5-moe"):
            w.add_expert_shared_feed_forward_length(ffn)
        if family in ("glm4moe", "deepseek2", "deepseek2-mla"):  # GLM-4.5, DeepSeek V3: layer 0 dense, shared
            # expert, sigmoid router with a selection bias, renormalised and scaled weights
            w.add_expert_shared_count(1)
            w.add_uint32(f"{arch}.leading_dense_block_count", 1)
            w.add_expert_weights_norm(True)
            w.add_expert_weights_scale(2.5)
            w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
            if family == "glm4moe":
                w.add_rope_dimension_count(hd // 2)  # partial rotary
            if family == "deepseek2-mla" and n_expert % 2 == 0 and n_expert >= 4:  # V3's expert groups
                w.add_uint32(f"{arch}.expert_group_count", 2)
                w.add_uint32(f"{arch}.expert_group_used_count", 1)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    extra = ("<|endoftext|>", "<|end|>") if family == "phi3" else ()  # llama.cpp's Phi-3 vocabulary needs them
    vocab = VOCAB + len(extra)
    _add_vocab(w, extra)
    qtype = gguf.GGMLQuantizationType[weight_type] if native else gguf.GGMLQuantizationType.F32

    def matrix(name: str, array: np.ndarray) -> None:
        mxfp4_dense = qtype == gguf.GGMLQuantizationType.MXFP4 and not name.endswith("_exps.weight")
        if qtype == gguf.GGMLQuantizationType.F32 or mxfp4_dense:  # gpt-oss files: MXFP4 experts only
            w.add_tensor(name, array)
        else:
            w.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)

    def vector(name: str, n: int, center: float = 1.0) -> None:
        w.add_tensor(name, _norm(rng, n, center))

    embed_scale = 1.0 / np.sqrt(width) if family in _GEMMA else 0.5
    matrix("token_embd.weight", (rng.standard_normal((vocab, width)) * embed_scale).astype(np.float32))
    if rope_freqs:
        w.add_tensor("rope_freqs.weight", np.linspace(1.0, 8.0, hd // 2).astype(np.float32))
    for il in range(n_layers):
        p = f"blk.{il}."
        if family != "olmo2":
            vector(p + "attn_norm.weight", width)
        if ds is not None:  # latent attention: low-rank query, compressed KV expanded per head
            k_head = ds["nope"] + ds["rot"]
            matrix(p + "attn_q_a.weight", _matrix(rng, ds["q_lora"], width))
            vector(p + "attn_q_a_norm.weight", ds["q_lora"])
            matrix(p + "attn_q_b.weight", _matrix(rng, heads * k_head, ds["q_lora"]))
            matrix(p + "attn_kv_a_mqa.weight", _matrix(rng, ds["kv_lora"] + ds["rot"], width))
            vector(p + "attn_kv_a_norm.weight", ds["kv_lora"])
            if mla:  # attn_kv_b split: K's part per head (transposed) and V's
                matrix(p + "attn_k_b.weight", np.stack([_matrix(rng, ds["nope"], ds["kv_lora"]).T
                                                        for _ in range(heads)]).copy())
                matrix(p + "attn_v_b.weight", np.stack([_matrix(rng, ds["v"], ds["kv_lora"]) for _ in range(heads)]))
            else:
                matrix(p + "attn_kv_b.weight", _matrix(rng, heads * (ds["nope"] + ds["v"]), ds["kv_lora"]))
            q_width = heads * ds["v"]  # what attn_output takes
        elif family == "phi3":
            matrix(p + "attn_qkv.weight", _matrix(rng, q_width + 2 * kv_width, width))
        else:
            matrix(p + "attn_q.weight", _matrix(rng, q_width, width))
            matrix(p + "attn_k.weight", _matrix(rng, kv_width, width))
            matrix(p + "attn_v.weight", _matrix(rng, kv_width, width))
        if family in ("qwen2", "qwen2moe", "gpt-oss", "glm4moe"):
            for name, n in (("attn_q.bias", q_width), ("attn_k.bias", kv_width), ("attn_v.bias", kv_width)):
                w.add_tensor(p + name, (0.1 * rng.standard_normal(n)).astype(np.float32))
        if family in ("qwen3", "qwen3moe", "gemma3"):
            vector(p + "attn_q_norm.weight", hd)
            vector(p + "attn_k_norm.weight", hd)
        if family == "olmo2":
            vector(p + "attn_q_norm.weight", q_width)
            vector(p + "attn_k_norm.weight", kv_width)
        matrix(p + "attn_output.weight", _matrix(rng, width, q_width))
        if family == "gpt-oss":
            w.add_tensor(p + "attn_output.bias", (0.1 * rng.standard_normal(width)).astype(np.float32))
            w.add_tensor(p + "attn_sinks.weight", rng.standard_normal(heads).astype(np.float32))
        if family in (*_GEMMA, "olmo2"):
            vector(p + "post_attention_norm.weight", width, 0.5)
        if family in ("gpt-oss", "glm4moe"):
            vector(p + "post_attention_norm.weight", width)
        elif family != "olmo2":
            vector(p + "ffn_norm.weight", width)
        if moe and not (family in ("glm4moe", "ernie4_5-moe", "deepseek2", "deepseek2-mla") and il == 0):
            matrix(p + "ffn_gate_inp.weight", _matrix(rng, n_expert, width, scale=1.0))
            stack = [_matrix(rng, ffn, width) for _ in range(n_expert)]
            matrix(p + "ffn_gate_exps.weight", np.stack(stack))
            matrix(p + "ffn_up_exps.weight", np.stack([_matrix(rng, ffn, width) for _ in range(n_expert)]))
            matrix(p + "ffn_down_exps.weight", np.stack([_matrix(rng, width, ffn) for _ in range(n_expert)]))
            if family == "gpt-oss":  # biases on the router and on every expert projection
                for name, shape in (("ffn_gate_inp.bias", (n_expert,)), ("ffn_gate_exps.bias", (n_expert, ffn)),
                                    ("ffn_up_exps.bias", (n_expert, ffn)), ("ffn_down_exps.bias", (n_expert, width))):
                    w.add_tensor(p + name, (0.1 * rng.standard_normal(shape)).astype(np.float32))
            if family == "qwen2moe":  # the shared expert's gate
                w.add_tensor(p + "ffn_gate_inp_shexp.weight", _matrix(rng, 1, width)[0])
            if family in ("glm4moe", "ernie4_5-moe", "deepseek2", "deepseek2-mla"):
                w.add_tensor(p + "exp_probs_b.bias", (0.1 * rng.standard_normal(n_expert)).astype(np.float32))
            if family in ("qwen2moe", "glm4moe", "ernie4_5-moe", "deepseek2", "deepseek2-mla"):  # one shared expert
                matrix(p + "ffn_gate_shexp.weight", _matrix(rng, ffn, width))
                matrix(p + "ffn_up_shexp.weight", _matrix(rng, ffn, width))
                matrix(p + "ffn_down_shexp.weight", _matrix(rng, width, ffn))
        elif family == "phi3":
            matrix(p + "ffn_up.weight", _matrix(rng, 2 * ffn, width))
            matrix(p + "ffn_down.weight", _matrix(rng, width, ffn))
        else:
            matrix(p + "ffn_gate.weight", _matrix(rng, ffn, width))
            matrix(p + "ffn_up.weight", _matrix(rng, ffn, width))
            matrix(p + "ffn_down.weight", _matrix(rng, width, ffn))
        if family in (*_GEMMA, "olmo2"):
            vector(p + "post_ffw_norm.weight", width, 0.5)
    vector("output_norm.weight", width)
    if family not in _GEMMA:  # Gemma ties its head to the embeddings
        matrix("output.weight", _matrix(rng, vocab, width, scale=2.0 / np.sqrt(width)))
    _finish(w)
    if not native:
        _quantize(target, path, weight_type)
        target.unlink()
    return path


def _quantize(src: Path, dst: Path, file_type: str) -> None:
    """Quantize ``src`` to ``dst`` with llama.cpp's own quantizer (file type ``Q4_K_M``, ``Q6_K``, ...)."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{file_type}")
    params.nthread = 1
    if llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {src} to {file_type}")


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
