"""Constrained decoding: the GBNF grammars (llama.cpp syntax, start rule ``root``) engines sample under.

Three sources, one converter: ``response_format`` ``json_object`` (any JSON object) and
``json_schema`` (the schema, through llama.cpp's own JSON-schema-to-GBNF converter as
llama-cpp-python ships it), and a forced ``tool_choice`` (``required`` or a named function): one
or more Hermes-style blocks ``<tool_call>\\n{"name": "<name>", "arguments": <arguments>}\\n</tool_call>``
whose arguments follow each function's parameter schema. That is the form
:class:`~meshllm.api.tools.ToolCallParser` reads and the tool emulation asks for, so a forced call
parses the same from any model. A request with both a forced tool and a response format gets the
tool grammar (the call is what was asked for); with ``tool_choice: auto`` and a response format,
the model may answer either way: ``root ::= tool-calls | format``.

Whitespace is limited to single optional spaces (the converter's convention) so that sampling
cannot run away in blank space.
"""

from __future__ import annotations

import json
from typing import Any

from meshllm.api.tools import HERMES_CLOSE, HERMES_OPEN, Function, ToolSpec
from meshllm.runtime.errors import BadRequest

MAX_GRAMMAR_CHARS = 256 * 1024
_LOOSE_CHAR = 'char ::= [^"\\\\] |'
_JSON_CHAR = 'char ::= [^"\\\\\\x7F\\x00-\\x1F] |'
"""The converter of llama-cpp-python 0.3.36 lets raw control characters into strings, which JSON forbids."""
"""A schema that converts to more than this is refused (400) rather than handed to llama.cpp."""


def _converter() -> Any:
    from llama_cpp.llama_grammar import SchemaConverter

    return SchemaConverter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)


def _literal(text: str) -> str:
    """A GBNF string literal (tool names are ``[a-zA-Z0-9_-]``; JSON-dumped text needs only these escapes)."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r") + '"'


UNENFORCED = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "uniqueItems",
                        "not", "if", "then", "else", "patternProperties", "propertyNames", "contains",
                        "minProperties", "maxProperties", "dependentRequired", "dependentSchemas"})
"""JSON-schema keywords the converter does not turn into grammar rules: a strict schema using one is a 400."""


def unenforced(schema: Any) -> str | None:
    """The first keyword of ``schema`` (at any depth) that sampling would not enforce, or ``None``."""
    if isinstance(schema, dict):
        for key, value in schema.items():
            if key in UNENFORCED:
                return key
            if key not in ("enum", "const", "default", "examples") and (found := unenforced(value)):
                return found
    elif isinstance(schema, list):
        return next((found for item in schema if (found := unenforced(item))), None)
    return None


def _visit(converter: Any, schema: Any, name: str, param: str, strict: bool = False) -> str:
    """Add ``schema``'s rules under ``name``; a schema the converter cannot take is a 400 naming ``param``.

    ``strict``: the client asked for output that always validates, so a keyword sampling cannot
    enforce is refused; otherwise the grammar enforces what it can (best effort, as non-strict
    schemas are at OpenAI).
    """
    if not isinstance(schema, dict):
        raise BadRequest(f"{param} must be a JSON schema object", param=param)
    if strict and (keyword := unenforced(schema)):
        raise BadRequest(f"{param}: the keyword {keyword!r} cannot be enforced while sampling; drop it or set "
                         "strict to false (then the rest of the schema is enforced)", param=param)
    try:
        resolved = converter.resolve_refs(json.loads(json.dumps(schema)), "input")
        return str(converter.visit(resolved, name))
    except BadRequest:
        raise
    except Exception as exc:  # the converter raises assorted errors for schemas it cannot express
        raise BadRequest(f"{param}: this JSON schema cannot be turned into a grammar ({exc})", param=param) from None


def _tool_rules(converter: Any, functions: tuple[Function, ...], parallel: bool) -> list[str]:
    """Rules for forced calls; the last line defines ``tool-calls``."""
    lines, alternatives = [], []
    for i, fn in enumerate(functions):
        args = _visit(converter, fn.parameters, f"tool{i}-arguments", f"tools[{i}].parameters", fn.strict)
        head = _literal('{"name": "' + fn.name + '", "arguments": ')
        lines.append(f"tool{i}-call ::= {head} {args} {_literal('}')}")
        alternatives.append(f"tool{i}-call")
    lines.append(f"tool-call ::= {_literal(HERMES_OPEN + chr(10))} ({' | '.join(alternatives)}) "
                 f"{_literal(chr(10) + HERMES_CLOSE)}")
    lines.append('tool-calls ::= tool-call ("\\n" tool-call)*' if parallel else "tool-calls ::= tool-call")
    return lines


def build_grammar(tools: ToolSpec, response_format: dict[str, Any] | None,
                  format_param: str = "response_format") -> str | None:
    """The grammar for a request, or ``None`` for free text.

    ``response_format`` is OpenAI's object (``{"type": "json_schema", "json_schema": {"schema": ...}}``)
    or the Responses API's flat ``text.format`` (``{"type": "json_schema", "schema": ...}``);
    ``format_param`` names it in errors.
    """
    kind = (response_format or {}).get("type", "text")
    if kind not in ("text", "json_object", "json_schema"):
        raise BadRequest(f"{format_param}.type {kind!r} is not one of text, json_object, json_schema",
                         param=f"{format_param}.type")
    if not tools.forced and kind == "text":
        return None
    converter = _converter()
    lines = _tool_rules(converter, tools.callable(), tools.parallel) if tools.active else []
    if tools.forced:
        root = "tool-calls"
    else:
        spec = response_format or {}
        inner = spec["json_schema"] if isinstance(spec.get("json_schema"), dict) else spec
        if kind == "json_object":
            schema, where = {"type": "object"}, format_param
        else:
            schema = inner.get("schema", {"type": "object"})
            where = f"{format_param}.json_schema.schema" if inner is not spec else f"{format_param}.schema"
        format_rule = _visit(converter, schema, "format", where, kind == "json_schema" and inner.get("strict") is True)
        root = f"tool-calls | {format_rule}" if lines else format_rule
    rules = converter.format_grammar().replace(_LOOSE_CHAR, _JSON_CHAR)
    grammar = f"root ::= {root}\n" + rules + ("\n" + "\n".join(lines) if lines else "")
    if len(grammar) > MAX_GRAMMAR_CHARS:
        raise BadRequest(f"the grammar for this request would be {len(grammar)} characters "
                         f"(limit {MAX_GRAMMAR_CHARS}); simplify the schema", param=format_param)
    return grammar
