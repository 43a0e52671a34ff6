"""A model's recommended sampling, filled into the fields a request leaves out.

Models are tuned for particular sampling settings (SmolLM2's card: temperature 0.2, top-p 0.9), and
a client that sends only messages should get them, not OpenAI's generic temperature 1. Precedence,
field by field:

1. what the request sets (every API: OpenAI chat and completions, Responses, Anthropic Messages);
2. the GGUF's ``general.sampling.*`` keys (llama.cpp's convention) when the file has them;
3. the node's ``config.toml`` ``[models.NAME]`` section (NAME: the model id, or the bundled
   reference ``default``/``smollm2``/``gemma``);
4. the bundled model's own recommendation (``models/bundled.py``);
5. OpenAI's defaults (temperature 1, top-p 1, no top-k, min-p or repetition penalty) and the
   node's ``--max-tokens-default``.

The API marks the fields a client left out (:attr:`GenerationParams.left_out`, ``max_tokens`` as
``None``); the node that *serves* the request fills them (:func:`admit`), so a routed request gets
the serving node's file and configuration, and a replay on another node gets that node's. A
``system_prompt`` is added as the first message of a chat that has no system or developer message.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from meshllm.engine.base import ChatMessage, ChatRequest, Engine, GenerationRequest, check_supported
from meshllm.errors import ConfigError
from meshllm.models.bundled import BUNDLED, SAMPLING, bundled_refs
from meshllm.models.metadata import read_metadata

log = logging.getLogger(__name__)

SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repeat_penalty")
"""Fields a client may leave out for the model's recommendation (``max_tokens`` aside: ``None``)."""
GGUF_KEYS = {
    "temperature": "general.sampling.temp",
    "top_p": "general.sampling.top_p",
    "top_k": "general.sampling.top_k",
    "min_p": "general.sampling.min_p",
    "repeat_penalty": "general.sampling.penalty_repeat",
}
"""Our field -> llama.cpp's GGUF key for it (``gguf.Keys.General.SAMPLING_*``)."""
CONFIG_KEYS = (*SAMPLING_FIELDS, "max_tokens", "system_prompt")


@dataclass(frozen=True)
class Recommended:
    """A model's recommended sampling; ``None``: no recommendation for that field."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    max_tokens: int | None = None
    system_prompt: str | None = None

    def over(self, fallback: Recommended) -> Recommended:
        """These values where set, ``fallback``'s elsewhere."""
        return Recommended(**{f.name: getattr(fallback, f.name) if getattr(self, f.name) is None
                              else getattr(self, f.name) for f in dataclasses.fields(self)})

    def fill(self, request: GenerationRequest) -> GenerationRequest:
        """``request`` with the fields its client left out set to these values (and ``left_out`` cleared)."""
        params = request.params
        changes: dict[str, Any] = {f: getattr(self, f) for f in params.left_out
                                   if f in SAMPLING_FIELDS and getattr(self, f) is not None}
        if params.max_tokens is None and self.max_tokens is not None:
            changes["max_tokens"] = self.max_tokens
        if params.left_out:
            changes["left_out"] = ()
        if changes:
            request = msgspec.structs.replace(request, params=msgspec.structs.replace(params, **changes))
        if self.system_prompt and isinstance(request, ChatRequest) \
                and not any(m.role in ("system", "developer") for m in request.messages):
            request = msgspec.structs.replace(
                request, messages=(ChatMessage("system", self.system_prompt), *request.messages))
        return request


def check_values(values: Mapping[str, Any], where: str) -> Recommended:
    """A :class:`Recommended` from ``values`` (keys of :data:`CONFIG_KEYS`); ``ValueError`` naming
    the first bad one (``where`` says whose)."""
    unknown = sorted(set(values) - set(CONFIG_KEYS))
    if unknown:
        raise ValueError(f"{where}: unknown settings {unknown} (known: {', '.join(CONFIG_KEYS)})")
    out: dict[str, Any] = {}
    for key, value in values.items():
        if key == "system_prompt":
            if not isinstance(value, str) or not value:
                raise ValueError(f"{where}: system_prompt must be a non-empty string")
            out[key] = value
            continue
        number = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        whole = number and float(value).is_integer()
        ok = {
            "temperature": number and 0.0 <= value <= 2.0,
            "top_p": number and 0.0 < value <= 1.0,
            "top_k": whole and value >= 0,
            "min_p": number and 0.0 <= value <= 1.0,
            "repeat_penalty": number and 0.0 < value <= 10.0,
            "max_tokens": whole and value >= 1,
        }[key]
        if not ok:
            raise ValueError(f"{where}: {key} = {value!r} is out of range")
        out[key] = int(value) if key in ("top_k", "max_tokens") else float(value)
    return Recommended(**out)


def from_gguf(fields: Mapping[str, Any], where: str) -> Recommended:
    """The ``general.sampling.*`` keys of a GGUF's metadata; a bad value is logged and skipped
    (a file's odd recommendation must not stop it serving)."""
    values: dict[str, Any] = {}
    for name, key in GGUF_KEYS.items():
        if key not in fields:
            continue
        try:
            check_values({name: fields[key]}, where)
        except ValueError as exc:
            log.warning("ignoring %s's %s: %s", where, key, exc)
        else:
            values[name] = fields[key]
    return check_values(values, where)


def from_config(section: Any, name: str) -> Recommended:
    """A ``config.toml`` ``[models.NAME]`` section; :class:`ConfigError` naming the bad setting."""
    if not isinstance(section, dict):
        raise ConfigError(f"config.toml: models.{name} must be a table ([models.{name}])")
    try:
        return check_values(section, f"config.toml [models.{name}]")
    except ValueError as exc:
        raise ConfigError(str(exc), hint="fix or remove that setting") from exc


def for_model(path: Path, model_id: str, sections: Mapping[str, Recommended]) -> Recommended:
    """The recommendation for the model file at ``path`` served as ``model_id``: its GGUF keys, over
    the ``config.toml`` section named by its id or a bundled reference, over the bundled default."""
    refs = bundled_refs(path)
    named = [sections[n] for n in (model_id, *refs) if n in sections]
    configured = named[0] if named else Recommended()
    bundled = check_values(SAMPLING[BUNDLED[refs[0]]], "bundled") if refs else Recommended()
    return from_gguf(read_metadata(path).fields, str(path)).over(configured.over(bundled))


def admit(engine: Engine, request: GenerationRequest) -> GenerationRequest:
    """``request`` as ``engine`` will run it: what its client left out filled from the model's
    recommendation, then checked against what the engine supports (:func:`check_supported`).
    Every place that hands a request to an engine calls this first."""
    if engine.recommended is not None:
        request = engine.recommended.fill(request)
    check_supported(engine, request)
    return request
