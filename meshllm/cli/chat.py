"""``meshllm chat``: talk to a running node's model from the terminal, or ask it one question.

Interactive on a terminal: answers stream in as they are generated, the conversation is kept for
the session and sent with each question, and a few slash commands change it (:data:`HELP`).
Ctrl-C stops the answer being written (the connection is closed, so the node stops generating)
and returns to the prompt; at the prompt it clears the line; Ctrl-D or ``/bye`` leaves.

One question (``-p TEXT``, or a question piped on stdin) prints its answer and exits. Output is
rendered with rich on a terminal and written as plain text otherwise, so ``meshllm chat -p ... >
answer.txt`` holds exactly the model's text.

The conversation and the input are sans-IO (:class:`Conversation`, :class:`InputLines`); the
command below only moves text between them, the terminal and the node's OpenAI API.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import click

from meshllm.cli.api_client import NodeApi, NodeApiError
from meshllm.cli.common import api_option
from meshllm.errors import MeshllmError

HELP = """\
/clear          forget the conversation (the system prompt stays)
/model [NAME]   switch to model NAME (without NAME: list the models)
/system [TEXT]  set the system prompt (without TEXT: remove it)
/help           this list
/bye            leave (also /exit, /quit, Ctrl-D)
A line ending in \\ continues on the next line; \"\"\" starts and ends a block of lines.
Ctrl-C stops an answer; at the prompt it clears the line."""

MULTILINE = '"""'
_UNPRINTABLE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
"""Control characters other than tab and newline: a model's text must not drive the user's terminal."""


def printable(text: str) -> str:
    """``text`` without control characters (escape sequences, carriage returns), for a terminal."""
    return _UNPRINTABLE.sub("", text)


@dataclass
class Conversation:
    """The session's messages: an optional system prompt, then question/answer turns."""

    model: str
    system: str = ""
    turns: list[dict[str, str]] = field(default_factory=list)

    def messages(self, question: str) -> list[dict[str, str]]:
        """What the next request sends: the system prompt, the turns so far and ``question``."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        return [*head, *self.turns, {"role": "user", "content": question}]

    def record(self, question: str, answer: str) -> None:
        """Keep a finished (or stopped) turn so later questions see it."""
        self.turns += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]

    def clear(self) -> None:
        """Forget the turns; the model and system prompt stay."""
        self.turns.clear()


class InputLines:
    """Joins typed lines into one message: ``\\`` at a line's end continues it, ``\"\"\"`` fences a block."""

    def __init__(self) -> None:
        self._lines: list[str] = []
        self._fenced = False

    @property
    def pending(self) -> bool:
        """Whether a message is half typed (the prompt shows ``...``)."""
        return bool(self._lines) or self._fenced

    def reset(self) -> None:
        """Drop a half-typed message (Ctrl-C at the prompt)."""
        self._lines, self._fenced = [], False

    def feed(self, line: str) -> str | None:
        """Take one typed line; the whole message once it is complete, else ``None``."""
        if self._fenced:
            if line.rstrip().endswith(MULTILINE):
                self._lines.append(line.rstrip()[: -len(MULTILINE)])
                return self._finish()
            self._lines.append(line)
            return None
        if not self._lines and line.lstrip().startswith(MULTILINE):
            rest = line.lstrip()[len(MULTILINE):]
            if rest.rstrip().endswith(MULTILINE) and rest.strip() != "":
                return rest.rstrip()[: -len(MULTILINE)].strip()
            self._fenced = True
            if rest.strip():
                self._lines.append(rest)
            return None
        if line.endswith("\\"):
            self._lines.append(line[:-1])
            return None
        self._lines.append(line)
        return self._finish()

    def _finish(self) -> str:
        text = "\n".join(self._lines).strip("\n")
        self.reset()
        return text


@dataclass(frozen=True)
class Options:
    """Request fields the user set on the command line (unset ones are left to the node)."""

    temperature: float | None = None
    max_tokens: int | None = None
    idle_timeout: float = 300.0

    def body(self, model: str, messages: list[dict[str, str]]) -> dict[str, Any]:
        body: dict[str, Any] = {"model": model, "messages": messages, "stream": True,
                                "stream_options": {"include_usage": True}}
        if self.temperature is not None:
            body["temperature"] = self.temperature
        if self.max_tokens is not None:
            body["max_tokens"] = self.max_tokens
        return body


@dataclass
class Answer:
    """One answer as it arrived: its text, why it ended, its token count and how long it took."""

    text: str = ""
    finish: str | None = None
    tokens: int | None = None
    prompt_tokens: int | None = None
    """What the question cost with the conversation before it (it grows with the history)."""
    seconds: float = 0.0
    stopped: bool = False


def answer_pieces(api: NodeApi, options: Options, model: str, messages: list[dict[str, str]],
                  answer: Answer) -> Iterator[str]:
    """Stream one chat completion, yielding its text pieces and filling ``answer`` as they come."""
    start = time.monotonic()
    with api.stream("POST", "/v1/chat/completions", options.body(model, messages),
                    idle_timeout=options.idle_timeout) as events:
        for event in events:
            if "error" in event:
                error = event["error"] if isinstance(event["error"], dict) else {"message": event["error"]}
                raise NodeApiError(f"the node stopped the answer: {error.get('message', error)}")
            usage = event.get("usage")
            if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
                answer.tokens = usage["completion_tokens"]
                answer.prompt_tokens = usage.get("prompt_tokens")
            for choice in event.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    answer.text += piece
                    yield piece
                if choice.get("finish_reason"):
                    answer.finish = choice["finish_reason"]
    answer.seconds = time.monotonic() - start


def served_models(api: NodeApi) -> list[str]:
    """The model ids the node answers for (its own and its peers'), from ``/v1/models``."""
    listing = api.get_json("/v1/models")
    data = listing.get("data") if isinstance(listing, dict) else None
    if not isinstance(data, list):
        raise NodeApiError(f"{api} answered /v1/models with something that is not a model list")
    return [str(m["id"]) for m in data if isinstance(m, dict) and "id" in m]


def pick_model(api: NodeApi, wanted: str | None) -> str:
    """``wanted`` if the node serves it, else the node's first model; a clear error when there is none."""
    models = served_models(api)
    if wanted is None:
        if not models:
            raise MeshllmError(f"the node at {api} serves no model yet",
                               hint="wait until it has loaded one, or start it with --model")
        return models[0]
    if wanted not in models:
        raise MeshllmError(f"the node at {api} does not serve {wanted!r}",
                           hint="models it serves: " + (", ".join(models) or "none yet"))
    return wanted


class Screen(Protocol):
    """Where the chat writes: a rich terminal or a plain stream."""

    def piece(self, text: str) -> None: ...
    def done(self, answer: Answer) -> None: ...
    def note(self, text: str) -> None: ...
    def error(self, text: str) -> None: ...


class PlainScreen:
    """Plain text on stdout (the model's text exactly), notes and errors on stderr."""

    def piece(self, text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    def done(self, answer: Answer) -> None:
        sys.stdout.write("\n")
        sys.stdout.flush()
        if answer.stopped:
            click.echo("[stopped]", err=True)

    def note(self, text: str) -> None:
        click.echo(text, err=True)

    def error(self, text: str) -> None:
        click.echo(f"error: {text}", err=True)


class RichScreen:
    """A terminal: the answer streams in colour without control characters, with a dim summary line."""

    def __init__(self) -> None:
        from rich.console import Console

        self.console = Console(highlight=False)

    def piece(self, text: str) -> None:
        self.console.print(printable(text), end="", style="cyan", markup=False, soft_wrap=True)

    def done(self, answer: Answer) -> None:
        self.console.print()
        if answer.stopped:
            self.console.print("[stopped]", style="yellow", markup=False)
        elif answer.tokens is not None and answer.seconds > 0:
            rate = answer.tokens / answer.seconds
            self.console.print(f"[{answer.tokens} tokens, {rate:.1f} tok/s, {answer.finish or 'ended'}; "
                               f"prompt {answer.prompt_tokens} tokens]", style="dim", markup=False)

    def note(self, text: str) -> None:
        self.console.print(text, style="dim", markup=False)

    def error(self, text: str) -> None:
        self.console.print(f"error: {text}", style="bold red", markup=False)

    def ask(self, prompt: str) -> str:
        return self.console.input(f"[bold green]{prompt}[/]")


def ask_once(api: NodeApi, options: Options, conversation: Conversation, question: str, screen: Screen) -> Answer:
    """Send ``question`` with the conversation so far, stream its answer to ``screen``, keep the turn.

    Ctrl-C stops the answer: leaving the stream closes the connection, so the node stops generating;
    the part already shown is kept in the conversation.
    """
    answer = Answer()
    try:
        for piece in answer_pieces(api, options, conversation.model, conversation.messages(question), answer):
            screen.piece(piece)
    except KeyboardInterrupt:
        answer.stopped = True
    screen.done(answer)
    conversation.record(question, answer.text)
    return answer


def run_command(line: str, api: NodeApi, conversation: Conversation, screen: Screen) -> bool:
    """Carry out one slash command; ``False`` when it asks to leave."""
    name, _, arg = line.strip().partition(" ")
    arg = arg.strip()
    if name in ("/bye", "/exit", "/quit"):
        return False
    if name == "/clear":
        conversation.clear()
        screen.note("conversation cleared")
    elif name == "/model":
        if not arg:
            models = served_models(api)
            screen.note(f"model: {conversation.model}; served: {', '.join(models) or 'none'}")
        else:
            conversation.model = pick_model(api, arg)
            screen.note(f"model: {conversation.model}")
    elif name == "/system":
        conversation.system = arg
        screen.note(f"system prompt: {arg}" if arg else "system prompt removed")
    elif name in ("/help", "/?"):
        screen.note(HELP)
    else:
        screen.error(f"unknown command {name}; /help lists them")
    return True


def interactive(api: NodeApi, options: Options, conversation: Conversation, screen: RichScreen) -> None:
    """The read-answer loop on a terminal, until Ctrl-D or /bye."""
    with contextlib.suppress(ImportError):  # not on every platform; plain input() still works
        import readline  # noqa: F401  (line editing and history for input())
    screen.note(f"meshllm chat with {conversation.model} at {api} (/help for commands, Ctrl-D to leave)")
    lines = InputLines()
    while True:
        try:
            message = lines.feed(screen.ask("... " if lines.pending else ">>> "))
        except KeyboardInterrupt:
            lines.reset()
            screen.console.print()
            continue
        except EOFError:
            screen.console.print()
            return
        if message is None or not message.strip():
            continue
        try:
            if message.startswith("/"):
                if not run_command(message, api, conversation, screen):
                    return
            else:
                ask_once(api, options, conversation, message, screen)
        except MeshllmError as exc:
            screen.error(f"{exc} ({exc.hint})" if exc.hint else str(exc))
        except KeyboardInterrupt:  # during a command's call to the node: back to the prompt, as for an answer
            screen.console.print("\n[stopped]", style="yellow", markup=False)


@click.command("chat")
@click.argument("model", required=False)
@click.option("-p", "--prompt", default=None, metavar="TEXT",
              help="Ask one question, print the answer and exit (stdin, when piped, is added after it).")
@click.option("--system", default="", metavar="TEXT", help="System prompt for the conversation.")
@click.option("--temperature", type=click.FloatRange(0.0, 2.0), default=None,
              help="Sampling temperature (default: the node's).")
@click.option("--max-tokens", type=click.IntRange(min=1), default=None,
              help="Longest answer in tokens (default: the node's).")
@click.option("--timeout", "idle_timeout", type=click.FloatRange(1.0, 3600.0), default=300.0, show_default=True,
              help="Give up on an answer when the node sends nothing for this many seconds.")
@api_option
def chat(model: str | None, prompt: str | None, system: str, temperature: float | None, max_tokens: int | None,
         idle_timeout: float, api: NodeApi) -> None:
    """Chat with MODEL (default: the node's first model) on the running node.

    On a terminal: an interactive chat (/help lists its commands). With -p TEXT, or a question piped
    on stdin, it answers once and exits; the answer is plain text when stdout is not a terminal.
    """
    question = prompt
    if not sys.stdin.isatty():
        piped = sys.stdin.read()
        question = f"{prompt}\n\n{piped}" if prompt and piped.strip() else (prompt or piped)
    if question is not None and not question.strip():
        raise click.UsageError("the question is empty (give -p TEXT or pipe some text)")
    options = Options(temperature, max_tokens, idle_timeout)
    conversation = Conversation(pick_model(api, model), system=system)
    screen: Screen = RichScreen() if sys.stdout.isatty() else PlainScreen()
    if question is not None:
        try:
            answer = ask_once(api, options, conversation, question.strip("\n"), screen)
        except BrokenPipeError:  # the reader left (`| head`): stop quietly, as other Unix tools do
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush cannot fail
            raise SystemExit(0) from None
        if answer.stopped:
            raise SystemExit(130)
        return
    if not isinstance(screen, RichScreen):
        raise click.UsageError("interactive chat needs a terminal; give -p TEXT or pipe a question")
    interactive(api, options, conversation, screen)
