"""The GBNF checker: what it lets through compiles in llama.cpp; what it refuses never reaches it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from tinymodels import write_tiny_llama

from meshllm.engine.gbnf import MAX_REPEAT, BadGrammar, check_grammar

JSON_LIKE = r'''
root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null") ws
object ::= "{" ws ( string ":" ws value ("," ws string ":" ws value)* )? "}" ws   # a comment
array  ::= "[" ws ( value ("," ws value)* )? "]" ws
string ::= "\"" ( [^"\\\x7F\x00-\x1F] | "\\" (["\\bfnrt] | "u" [0-9a-fA-F]{4}) )* "\"" ws
number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [0-9]{1,3})? ws
ws     ::= | " " | "\n" [ \t]{0,20}
'''

GOOD = [JSON_LIKE, 'root ::= "a" | "b"', 'root ::= x{2,5} "!"\nx ::= [a-z]', 'root ::= ( "a"\n  | "b" )+',
        'root ::= .{0,10} "\\u00e9" "\\U0001F600"', "root ::= [^\\]\\[]*"]
BAD = [
    ('root ::= "a"{2,1}', "minimum above its maximum"),
    (f'root ::= "a"{{0,{MAX_REPEAT + 1}}}', "repetition count over"),
    ('root ::= ("a"{0,900}){0,900}', "expand past"),
    ('root ::= foo', "'foo' is used but never defined"),
    ('start ::= "a"', "no 'root' rule"),
    ('root ::= "a', "unterminated string"),
    ('root ::= [a-', "unterminated character class"),
    ('root ::= "\\q"', "unknown escape"),
    ('root ::= "\\x4"', "bad \\x escape"),
    ('root ::= * "a"', "nothing before it"),
    ('root ::= ("a"', "expected ')'"),
    ('root ::= "a"\nroot ::= "b"', "defined twice"),
    ('root "a"', "expected '::='"),
    ('root ::= "a" <tok>', "unexpected"),
    ("root ::= \"a\0\"", "NUL"),
    ("root ::= \"\ud800\"", "not valid UTF-8"),
    ("", "no 'root' rule"),
]


@pytest.mark.parametrize("grammar", GOOD)
def test_valid_grammars_pass(grammar: str) -> None:
    assert check_grammar(grammar) == grammar.encode()


@pytest.mark.parametrize(("grammar", "why"), BAD)
def test_bad_grammars_are_refused_with_the_reason(grammar: str, why: str) -> None:
    with pytest.raises(BadGrammar, match=re.escape(why)):
        check_grammar(grammar)


def test_errors_name_line_and_column() -> None:
    with pytest.raises(BadGrammar, match="line 2, column 10"):
        check_grammar('root ::= x\nx ::= "a"{3,2}')


def test_what_passes_compiles_in_llama_cpp(tmp_path: Path) -> None:
    from meshllm.engine.llama_native import NativeModel, NativeSampler

    model = NativeModel(write_tiny_llama(tmp_path / "tiny.gguf"))
    try:
        for grammar in GOOD:
            NativeSampler.grammar(model, grammar).close()
        with pytest.raises(BadGrammar, match=r"llama\.cpp refused"):
            NativeSampler.grammar(model, "root ::= root \"a\"")  # left recursion: llama.cpp's own check
    finally:
        model.close()
