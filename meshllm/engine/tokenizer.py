"""Tokenizer and chat template of a GGUF, through llama-cpp-python loaded with ``vocab_only=True``.

Loading only the vocabulary takes well under a second and no weight memory, and reusing llama.cpp's
tokenizer guarantees the ggml stage runtime sees exactly the token ids llama.cpp would, which the
comparison tests (and mixed llama.cpp / ggml-runtime meshes) depend on. Chat prompts come from the GGUF's
template when it has one, else from the family's llama-cpp-python format (the bundled Gemma 3 270M has
no template): :func:`meshllm.engine.chat_format.chat_renderer`, as :class:`meshllm.engine.llama.LlamaEngine`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import llama_cpp
from llama_cpp import Llama

from meshllm.engine.base import BadChat, ChatRequest, GenerationRequest, Unsupported
from meshllm.engine.chat_format import ChatTemplate, chat_renderer, family_of
from meshllm.engine.llama_native import longest_token
from meshllm.engine.text import tokenize_bounded


class Tokenizer:
    """Text <-> token ids for one GGUF, plus chat rendering and end-of-generation detection."""

    def __init__(self, path: str | Path, architecture: str, chat_template: str | None) -> None:
        self._llama = Llama(model_path=str(path), vocab_only=True, verbose=False)
        self._vocab = self._llama._model.vocab
        self.longest_token = longest_token(self._vocab)
        self._render: ChatTemplate
        self._render, self.chat_format = chat_renderer(self._llama, family_of(architecture), chat_template)

    def encode(self, text: str, *, add_bos: bool = True, special: bool = False) -> list[int]:
        """Token ids of ``text``; ``special`` parses control tokens written in the text (chat prompts)."""
        return list(self._llama.tokenize(text.encode("utf-8"), add_bos=add_bos, special=special))

    def token_bytes(self, token: int) -> bytes:
        """The bytes one token stands for (may be part of a UTF-8 character)."""
        return bytes(self._llama.detokenize([token]))

    def decode(self, tokens: Sequence[int]) -> str:
        """Text of ``tokens`` (invalid UTF-8 replaced)."""
        return bytes(self._llama.detokenize(list(tokens))).decode("utf-8", errors="replace")

    def is_end(self, token: int) -> bool:
        """Whether ``token`` ends generation (EOS, end of turn and the model's other end markers)."""
        return bool(llama_cpp.llama_vocab_is_eog(self._vocab, token))

    def request_prompt(self, request: GenerationRequest, model_id: str, context: int
                       ) -> tuple[list[int], tuple[str, ...]]:
        """The tokens to feed for an API request and its stop strings (the client's plus the chat format's).

        Raises :class:`BadChat` when the chat format cannot express the conversation, and
        :class:`PromptTooLong` as soon as a text prompt is seen not to fit ``context`` (:func:`tokenize_bounded`).
        """
        stops = list(request.params.stop)
        if isinstance(request, ChatRequest):
            try:
                rendered = self._render.render(request)
            except BadChat as exc:
                raise BadChat(f"model {model_id}: {exc}") from exc
            tokens = self._bounded(rendered.prompt, model_id, context, add_bos=not rendered.added_special, special=True)
            stops += rendered.stop
        elif isinstance(request.prompt, str):
            tokens = self._bounded(request.prompt, model_id, context, add_bos=True, special=False)
        else:
            tokens = self.ids(request.prompt)
        return tokens, tuple(s for s in stops if s)

    def _bounded(self, text: str, model_id: str, context: int, *, add_bos: bool, special: bool) -> list[int]:
        return tokenize_bounded(
            lambda b: list(self._llama.tokenize(b, add_bos=add_bos, special=special)),
            lambda b: len(self._llama.tokenize(b, add_bos=False, special=special)),
            text.encode("utf-8"), context, self.longest_token, model_id)

    def ids(self, tokens: Sequence[int]) -> list[int]:
        """A token-id prompt as given, refused (naming ``prompt``) when an id is outside the vocabulary."""
        vocab = self._llama.n_vocab()
        bad = next((t for t in tokens if not 0 <= t < vocab), None)
        if bad is not None or not tokens:
            raise Unsupported(f"token id {bad} is outside the vocabulary of {vocab}" if bad is not None
                              else "the token-id prompt is empty", param="prompt")
        return list(tokens)


    def close(self) -> None:
        """Free llama.cpp's vocabulary."""
        self._llama.close()
