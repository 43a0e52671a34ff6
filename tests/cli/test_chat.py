"""``meshllm chat`` against a real node serving two tiny models: driven in tmux as a user types, and
one-shot with ``-p`` and a pipe. Also the sans-IO conversation and input joining it is built on.

The tool model answers ``OK`` to any chat without tools (tests/tinymodels.py), so the interactive
run can check each answer exactly; the prompt token counts the chat prints show the history being
sent, and forgotten after ``/clear``. The random tiny llama writes 1,500 greedy tokens, long enough
to stop mid-answer: the node is paused (SIGSTOP) once text has appeared, so Ctrl-C surely lands
before the answer could end on its own.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from nodes import NodeProcess, meshllm, running_nodes, wait_until
from tinymodels import TOOL_MODEL, TOOL_MODEL_REPLY, write_tiny_llama, write_tiny_tool_model

from meshllm.cli.chat import Conversation, InputLines, printable

ROOT = Path(__file__).resolve().parents[2]


def test_input_lines_join_continuations_and_fenced_blocks() -> None:
    lines = InputLines()
    assert lines.feed("hello") == "hello"
    assert lines.feed("first \\") is None and lines.pending
    assert lines.feed("second") == "first \nsecond"
    assert lines.feed('"""') is None
    assert lines.feed("a") is None
    assert lines.feed('b"""') == "a\nb"
    assert lines.feed('"""one line"""') == "one line"
    assert lines.feed('"""x') is None
    lines.reset()
    assert not lines.pending and lines.feed("y") == "y"


def test_conversation_keeps_turns_and_system_prompt() -> None:
    talk = Conversation("m", system="be brief")
    talk.record("q1", "a1")
    assert talk.messages("q2") == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q1"},
                                   {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"}]
    talk.clear()
    assert talk.messages("q3") == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q3"}]


def test_printable_drops_terminal_controls() -> None:
    assert printable("a\x1b[2Jb\rc\x07\td\ne\x9b") == "a[2Jbc\td\ne"


@pytest.fixture(scope="module")
def chat_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    """A node serving the tool model and a random tiny llama (its first model, by name)."""
    tmp = tmp_path_factory.mktemp("chat")
    tool = write_tiny_tool_model(tmp / f"{TOOL_MODEL}.gguf")
    llama = write_tiny_llama(tmp / "tiny-llama.gguf", seed=0)
    with running_nodes() as nodes:
        node = NodeProcess(tmp / "home", ["--model", str(tool), "--model", str(llama), "--threads", "1"], "chat")
        nodes.append(node)
        node.wait_ready()
        wait_until(lambda: len([m for m in httpx.get(node.api + "/v1/models", timeout=5).json()["data"]
                                if m["id"] != "auto"]) == 2, 30.0)
        yield node


class Tmux:
    """A private tmux server (its own socket) running one command in a 120x40 pane."""

    def __init__(self, command: str) -> None:
        self.socket = f"meshllm-chat-test-{uuid.uuid4().hex[:8]}"
        self.tmux("new-session", "-d", "-s", "t", "-x", "120", "-y", "40", "-c", str(ROOT), command)

    def tmux(self, *args: str) -> str:
        return subprocess.run(["tmux", "-L", self.socket, *args], capture_output=True, text=True, timeout=10,
                              check=True).stdout

    def screen(self) -> str:
        return self.tmux("capture-pane", "-p", "-J", "-S", "-", "-t", "t")

    def type(self, text: str) -> None:
        self.tmux("send-keys", "-t", "t", "-l", text)
        self.tmux("send-keys", "-t", "t", "Enter")

    def wait_for(self, test: Callable[[str], bool], timeout: float = 30.0, interval: float = 0.1) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.screen()
            if test(text):
                return text
            time.sleep(interval)
        raise AssertionError(f"screen never matched; last screen:\n{self.screen()}")

    def close(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True, timeout=10)


@pytest.fixture
def term() -> Iterator[list[Tmux]]:
    """Where a test puts its terminals; each is closed afterwards."""
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed (apt-get install -y tmux); the chat needs a real terminal")
    terms: list[Tmux] = []
    yield terms
    for t in terms:
        t.close()


def prompts(screen: str) -> list[int]:
    """The prompt token counts of the answers' summary lines, in order."""
    return [int(n) for n in re.findall(r"prompt (\d+) tokens\]", screen)]


def test_interactive_chat_in_a_terminal(chat_node: NodeProcess, term: list[Tmux], tmp_path: Path) -> None:
    after = tmp_path / "after.txt"
    cmd = (f"{sys.executable} -m meshllm chat {TOOL_MODEL} {' '.join(chat_node.api_args)} --temperature 0 "
           f"--max-tokens 1500; echo exit=$? > {after}; echo DONE; sleep 60")
    t = Tmux(f"bash -c {json.dumps(cmd)}")
    term.append(t)
    t.wait_for(lambda s: f"chat with {TOOL_MODEL}" in s and ">>> " in s)

    # a question streams its answer, a summary follows; a second one carries the first turn
    t.type("hello")
    screen = t.wait_for(lambda s: len(prompts(s)) == 1)
    assert re.search(rf"^{TOOL_MODEL_REPLY}$", screen, re.M), screen
    t.type("hello")
    screen = t.wait_for(lambda s: len(prompts(s)) == 2)
    first, second = prompts(screen)
    assert second > first

    # /clear forgets the history: the same question costs what it did first
    t.type("/clear")
    t.wait_for(lambda s: "conversation cleared" in s)
    t.type("hello")
    assert prompts(t.wait_for(lambda s: len(prompts(s)) == 3))[2] == first

    # a block of lines is one message; /system adds a system prompt
    t.type('"""')
    t.type("line one")
    t.type('line two"""')
    multi = prompts(t.wait_for(lambda s: len(prompts(s)) == 4))[3]
    t.type("/clear")
    t.type("/system answer briefly")
    t.wait_for(lambda s: "system prompt: answer briefly" in s)
    t.type("hello")
    assert prompts(t.wait_for(lambda s: len(prompts(s)) == 5))[4] > first
    assert multi > first

    # Ctrl-C stops a long answer and returns to the prompt; the node stops generating
    t.type("/model tiny-llama")
    t.wait_for(lambda s: "model: tiny-llama" in s)
    t.type("tell me everything")
    t.wait_for(lambda s: len(s.split("tell me everything")[-1].strip()) > 20, interval=0.02)
    os.kill(chat_node.proc.pid, signal.SIGSTOP)
    try:
        t.tmux("send-keys", "-t", "t", "C-c")
        screen = t.wait_for(lambda s: "[stopped]" in s)
    finally:
        os.kill(chat_node.proc.pid, signal.SIGCONT)
    assert "Traceback" not in screen
    wait_until(lambda: chat_node.status()["load"]["in_flight"] == 0, 15.0)

    # still chatting afterwards; Ctrl-C at the prompt drops the half-typed line; /bye leaves with 0
    t.type("/model " + TOOL_MODEL)
    t.wait_for(lambda s: f"model: {TOOL_MODEL}" in s)
    t.type("/clear")
    t.wait_for(lambda s: s.count("conversation cleared") == 3)
    t.tmux("send-keys", "-t", "t", "-l", "a half typed line")
    t.wait_for(lambda s: "a half typed line" in s)
    t.tmux("send-keys", "-t", "t", "C-c")
    t.type("hello")
    with_system = prompts(t.wait_for(lambda s: len(prompts(s)) == 6))
    assert with_system[5] == with_system[4]  # the same question on a cleared history: the dropped line was not sent
    t.type("/bye")
    t.wait_for(lambda s: "DONE" in s)
    assert after.read_text().strip() == "exit=0"


def test_one_shot_on_a_terminal_and_through_pipes(chat_node: NodeProcess, term: list[Tmux], tmp_path: Path) -> None:
    api = " ".join(chat_node.api_args)
    cmd = (f"{sys.executable} -m meshllm chat {TOOL_MODEL} {api} -p hello; echo exit=$?; "
           f"echo hello | {sys.executable} -m meshllm chat {TOOL_MODEL} {api}; echo exit=$?; sleep 60")
    t = Tmux(f"bash -c {json.dumps(cmd)}")
    term.append(t)
    screen = t.wait_for(lambda s: s.count("exit=") == 2)
    assert screen.count("exit=0") == 2, screen
    assert len(prompts(screen)) == 2 and re.search(rf"^{TOOL_MODEL_REPLY}$", screen, re.M), screen

    # not a terminal: exactly the model's text on stdout
    piped = subprocess.run([sys.executable, "-m", "meshllm", "chat", TOOL_MODEL, *chat_node.api_args],
                           input="hello\n", capture_output=True, text=True, timeout=60)
    assert (piped.returncode, piped.stdout) == (0, TOOL_MODEL_REPLY + "\n"), piped.stderr
    done = meshllm("chat", *chat_node.api_args, "-p", "hello", "--system", "be brief", "--max-tokens", "4")
    assert done.returncode == 0 and done.stdout.endswith("\n"), done.stderr  # the first model: tiny-llama's noise


def test_chat_errors_are_one_line(chat_node: NodeProcess, tmp_path: Path) -> None:
    missing = meshllm("chat", "nope", *chat_node.api_args, "-p", "hi")
    assert missing.returncode == 1 and "does not serve 'nope'" in missing.stderr and "tiny-tools" in missing.stderr
    empty = subprocess.run([sys.executable, "-m", "meshllm", "chat", *chat_node.api_args], input="  \n",
                           capture_output=True, text=True, timeout=60)
    assert empty.returncode == 2 and "question is empty" in empty.stderr
    nobody = meshllm("chat", "--api", "http://127.0.0.1:9", "--home", str(tmp_path), "-p", "hi")
    assert nobody.returncode == 1 and "no meshllm node is running" in nobody.stderr
    head = subprocess.run(f"{sys.executable} -m meshllm chat tiny-llama {' '.join(chat_node.api_args)} -p hi "
                          "--temperature 0 --max-tokens 1500 | head -c 1; exit ${PIPESTATUS[0]}", shell=True,
                          executable="/bin/bash", capture_output=True, timeout=60)
    assert (head.returncode, len(head.stdout), head.stderr) == (0, 1, b"")  # a reader leaving early is no error
    for done in (missing, empty, nobody):
        assert "Traceback" not in done.stderr
