"""``meshllm launch``: each agent's variables and arguments, the command against a real node, and a real agent.

The last tests install real agents from the npm registry (pinned versions, into a cache folder
reused by later runs) and have each complete one turn against a node serving the tiny tool
model. Codex sends its Responses request with its tools, the model calls a tool Codex does not
have, Codex answers with the error, and the model's reply ends the turn; opencode does the same
over chat completions; Claude Code in print mode sends a Messages request and prints the reply.
They are skipped, saying why, when npm or the package cannot be had.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from nodes import NodeProcess, meshllm, running_nodes
from tinymodels import TOOL_MODEL, TOOL_MODEL_REPLY, write_tiny_tool_model

from meshllm.cli.launch import AGENTS, PLACEHOLDER_KEY, plan

pytestmark = pytest.mark.timeout(300)

API = "http://127.0.0.1:9999"
CODEX = "@openai/codex@0.171.0"
CLAUDE_CODE = "@anthropic-ai/claude-code@2.1.197"
OPENCODE = "opencode-ai@1.18.33"
"""The agent versions the real-agent tests were written against (their flags change between releases)."""


def test_claude_code_gets_anthropic_variables_for_every_model_tier() -> None:
    job = plan("claude", API, "m", args=["-p", "hello"])
    assert job.argv == ["claude", "-p", "hello"]
    assert job.env["ANTHROPIC_BASE_URL"] == API
    assert job.env["ANTHROPIC_AUTH_TOKEN"] == job.env["ANTHROPIC_API_KEY"] == PLACEHOLDER_KEY
    for tier in ("ANTHROPIC_MODEL", "ANTHROPIC_SMALL_FAST_MODEL", "ANTHROPIC_DEFAULT_OPUS_MODEL",
                 "ANTHROPIC_DEFAULT_SONNET_MODEL", "ANTHROPIC_DEFAULT_HAIKU_MODEL"):
        assert job.env[tier] == "m"
    assert job.env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == "1"
    assert plan("claude", API, "m", api_key="sk-node").env["ANTHROPIC_AUTH_TOKEN"] == "sk-node"


def test_codex_gets_a_responses_provider_as_overrides() -> None:
    job = plan("codex", API, "m", context=4096, args=["exec", "hi"])
    assert job.argv[0] == "codex" and job.argv[-3:] == ["m", "exec", "hi"]
    provider = job.argv[job.argv.index("-c") + 1]
    assert provider.startswith("model_providers.meshllm={") and f'base_url = "{API}/v1"' in provider
    assert 'wire_api = "responses"' in provider and 'env_key = "MESHLLM_API_KEY"' in provider
    assert "model_provider=meshllm" in job.argv and "model_context_window=4096" in job.argv
    assert job.env == {"MESHLLM_API_KEY": PLACEHOLDER_KEY}


def test_opencode_gets_an_openai_compatible_provider() -> None:
    job = plan("opencode", API, "m", api_key="k", context=8192)
    config = json.loads(job.env["OPENCODE_CONFIG_CONTENT"])
    provider = config["provider"]["meshllm"]
    assert provider["npm"] == "@ai-sdk/openai-compatible" and provider["options"] == {"baseURL": f"{API}/v1",
                                                                                      "apiKey": "k"}
    assert provider["models"]["m"]["limit"] == {"context": 8192, "output": 2048}  # room left for input
    assert config["model"] == config["small_model"] == "meshllm/m" and job.argv == ["opencode"]


def test_claude_codex_and_opencode_get_the_nodes_mcp_server_with_its_secret() -> None:
    claude = plan("claude", API, "m", args=["-p", "hi"], mcp_secret="tok")
    assert claude.argv[:3] == ["claude", "-p", "hi"] and claude.argv[3] == "--mcp-config"
    assert json.loads(claude.argv[4]) == {"mcpServers": {"meshllm": {
        "type": "http", "url": f"{API}/mcp", "headers": {"Authorization": "Bearer tok"}}}}
    codex = plan("codex", API, "m", mcp_secret="tok")
    assert f'mcp_servers.meshllm={{ url = "{API}/mcp", bearer_token_env_var = "MESHLLM_MCP_TOKEN" }}' in codex.argv
    assert codex.env["MESHLLM_MCP_TOKEN"] == "tok"
    opencode = json.loads(plan("opencode", API, "m", mcp_secret="tok").env["OPENCODE_CONFIG_CONTENT"])
    assert opencode["mcp"] == {"meshllm": {"type": "remote", "url": f"{API}/mcp",
                                           "headers": {"Authorization": "Bearer tok"}, "enabled": True}}
    assert plan("goose", API, "m", mcp_secret="tok") == plan("goose", API, "m")  # goose takes no MCP headers
    for agent in ("claude", "codex", "opencode"):  # no secret for /mcp: no MCP server
        assert "mcp" not in plan(agent, API, "m").shell()


def test_goose_gets_its_openai_provider() -> None:
    job = plan("goose", API, "m")
    assert job.argv == ["goose", "session"]
    assert job.env == {"GOOSE_PROVIDER": "openai", "GOOSE_MODEL": "m", "OPENAI_HOST": API,
                       "OPENAI_BASE_PATH": "v1/chat/completions", "OPENAI_API_KEY": PLACEHOLDER_KEY}


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    """A real node serving the tiny tool model."""
    tmp = tmp_path_factory.mktemp("launch")
    gguf = write_tiny_tool_model(tmp / f"{TOOL_MODEL}.gguf")
    with running_nodes() as nodes:
        nodes.append(NodeProcess(tmp / "home", ["--model", str(gguf), "--threads", "1"], "launcher"))
        nodes[0].wait_ready()
        yield nodes[0]


@pytest.mark.parametrize("agent", AGENTS)
def test_print_shows_what_would_run_against_the_node(node: NodeProcess, agent: str) -> None:
    done = meshllm("launch", agent, *node.api_args, "--print", timeout=30)
    assert done.returncode == 0, done.stderr
    assert node.api in done.stdout and TOOL_MODEL in done.stdout
    assert done.stdout.strip().splitlines()[-1].startswith(agent)
    assert (f"{node.api}/mcp" in done.stdout) == (agent != "goose")


def test_launch_runs_the_agent_with_its_variables(node: NodeProcess, tmp_path: Path) -> None:
    fake = tmp_path / "claude"
    fake.write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                    "print(json.dumps({'argv': sys.argv[1:], 'base': os.environ['ANTHROPIC_BASE_URL'], "
                    "'model': os.environ['ANTHROPIC_MODEL']}))\n")
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run([sys.executable, "-m", "meshllm", "launch", "claude", "--api", node.api, "--", "-p", "hi"],
                          capture_output=True, text=True, env=env, timeout=30)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"argv": ["-p", "hi"], "base": node.api, "model": TOOL_MODEL}


def test_clear_errors_for_an_unknown_model_or_a_missing_agent(node: NodeProcess, tmp_path: Path) -> None:
    unknown = meshllm("launch", "codex", "--api", node.api, "--model", "nope", "--print", timeout=30)
    assert unknown.returncode == 1 and "nope" in unknown.stderr and TOOL_MODEL in unknown.stderr
    env = {**os.environ, "PATH": str(tmp_path)}  # no agent here
    missing = subprocess.run([sys.executable, "-m", "meshllm", "launch", "goose", "--api", node.api],
                             capture_output=True, text=True, env=env, timeout=30)
    assert missing.returncode == 1 and "goose is not installed" in missing.stderr
    assert "Traceback" not in missing.stderr + unknown.stderr


def installed(package: str, command: str) -> Path:
    """A pinned agent CLI from the npm registry, installed once into a cache folder; skips when it cannot be."""
    npm = shutil.which("npm")
    if npm is None or shutil.which("node") is None:
        pytest.skip("npm and node are not installed, so no agent CLI can be installed from the npm registry")
    cache = Path(os.environ.get("MESHLLM_TEST_AGENTS") or Path.home() / ".cache" / "meshllm-test-agents")
    prefix = cache / package.replace("/", "+")
    binary = prefix / "node_modules" / ".bin" / command
    if not binary.exists():
        try:
            done = subprocess.run([npm, "install", "--prefix", str(prefix), "--no-audit", "--no-fund", package],
                                  capture_output=True, text=True, timeout=240)
        except subprocess.TimeoutExpired:
            pytest.skip(f"npm did not install {package} within 240 s")
        if done.returncode != 0 or not binary.exists():
            pytest.skip(f"npm could not install {package}: {done.stderr.strip()[-300:]}")
    version = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    if version.returncode != 0:
        pytest.skip(f"{package} does not run here: {(version.stderr or version.stdout).strip()[-300:]}")
    return binary


def run_agent(agent: str, binary: Path, api: str, args: list[str], home: Path,
              node_home: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``meshllm launch <agent> --api <api> -- <args>`` with the installed agent first on PATH.

    With ``node_home`` launch reads the node's admin token there and hands the agent the node's MCP server.
    """
    home.mkdir(exist_ok=True)
    env = {**os.environ, "PATH": f"{binary.parent}{os.pathsep}{os.environ['PATH']}", "HOME": str(home),
           "CODEX_HOME": str(home), "PWD": str(home)}  # opencode finds its project by $PWD, as a shell sets it
    where = ["--home", str(node_home)] if node_home is not None else []
    return subprocess.run([sys.executable, "-m", "meshllm", "launch", agent, "--api", api, *where, "--", *args],
                          capture_output=True, text=True, env=env, timeout=120, stdin=subprocess.DEVNULL, cwd=home)


def test_a_real_codex_cli_completes_a_turn_against_the_node(node: NodeProcess, tmp_path: Path) -> None:
    binary = installed(CODEX, "codex")
    instructions = tmp_path / "instructions.md"
    instructions.write_text("Answer briefly.")
    # Codex's default prompt and tools are ~40 KB; the tiny model reads one token per byte, so the
    # test keeps Codex's own instructions and optional tools out (its request is then ~5 KB).
    slim = ["-c", f"model_instructions_file={json.dumps(str(instructions))}", "-c", "skills.include_instructions=false",
            "-c", "skills.bundled.enabled=false", "-c", 'web_search="disabled"',
            *[arg for feature in ("multi_agent", "goals", "skill_search", "plugins", "apps", "shell_tool",
                                  "image_generation", "view_image") for arg in ("--disable", feature)]]
    done = run_agent("codex", binary, node.api, ["exec", "--skip-git-repo-check", *slim, "Say hi"], tmp_path / "h")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == TOOL_MODEL_REPLY, done.stdout[-2000:]


def test_claude_code_in_print_mode_completes_a_turn_against_the_node(node: NodeProcess, tmp_path: Path) -> None:
    binary = installed(CLAUDE_CODE, "claude")
    # Without its ~78 KB of built-in tools and system prompt (one token per byte for the tiny model).
    done = run_agent("claude", binary, node.api, ["-p", "Say hi", "--bare", "--tools", "",
                                                  "--system-prompt", "Answer briefly."], tmp_path / "h")
    assert done.returncode == 0, done.stderr[-2000:] + done.stdout[-2000:]
    assert done.stdout.strip() == TOOL_MODEL_REPLY


BOARD_TOOLS = ("blackboard_post", "blackboard_search", "blackboard_feed")


def test_claude_code_gets_the_blackboard_tools_from_the_nodes_mcp_server(node: NodeProcess, tmp_path: Path) -> None:
    """Claude Code's init message (stream-json) names the MCP servers it connected and every tool it has."""
    binary = installed(CLAUDE_CODE, "claude")
    done = run_agent("claude", binary, node.api, ["-p", "Say hi", "--bare", "--tools", "", "--system-prompt",
                                                  "Answer briefly.", "--output-format", "stream-json", "--verbose"],
                     tmp_path / "h", node_home=node.home)
    assert done.returncode == 0, done.stderr[-2000:] + done.stdout[-2000:]
    init = next(m for m in map(json.loads, done.stdout.splitlines()) if m.get("subtype") == "init")
    assert {"name": "meshllm", "status": "connected"} in init["mcp_servers"], init["mcp_servers"]
    assert {f"mcp__meshllm__{t}" for t in BOARD_TOOLS} <= set(init["tools"]), init["tools"]


def test_opencode_runs_a_turn_with_a_tool_call_against_the_node(node: NodeProcess, tmp_path: Path) -> None:
    """opencode's chat-completions turn: the model calls a tool opencode lacks, opencode answers with the
    error, the model's reply ends the turn. The node's 4,096-token context is what launch gives opencode:
    with an output limit as large as the context, opencode compacted after every reply and never ended."""
    binary = installed(OPENCODE, "opencode")
    project = tmp_path / "h"
    project.mkdir()
    # opencode's own prompt and tools are ~40 KB (one token per byte for the tiny model): a project
    # config keeps one tool and a one-line prompt (launch's config is merged over it).
    (project / "opencode.json").write_text(json.dumps(
        {"agent": {"build": {"prompt": "Answer briefly.", "tools": {"*": False, "read": True}}}}))
    done = run_agent("opencode", binary, node.api, ["run", "Say hi"], project)
    assert done.returncode == 0, done.stderr[-2000:] + done.stdout[-2000:]
    assert "get_weather" in done.stderr and "Available tools: read" in done.stderr, done.stderr[-2000:]
    assert done.stdout.strip() == TOOL_MODEL_REPLY, done.stdout[-2000:]


def test_opencode_offers_the_blackboard_tools_from_the_nodes_mcp_server(node: NodeProcess, tmp_path: Path) -> None:
    """The same turn with launch's MCP server: the tools opencode lists to the model (in its answer to the
    model's call of a tool it lacks) are the blackboard's, which it took from /mcp. (With only those tools
    opencode keeps asking the model to go on, so the test stops it once the list is out.)"""
    binary = installed(OPENCODE, "opencode")
    project = tmp_path / "h"
    project.mkdir()
    (project / "opencode.json").write_text(json.dumps(
        {"agent": {"build": {"prompt": "Answer briefly.", "tools": {"*": False, "meshllm_blackboard_*": True}}}}))
    env = {**os.environ, "PATH": f"{binary.parent}{os.pathsep}{os.environ['PATH']}", "HOME": str(project),
           "PWD": str(project)}
    agent = subprocess.Popen([sys.executable, "-m", "meshllm", "launch", "opencode", *node.api_args, "--", "run",
                              "Say hi"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                             text=True, env=env, cwd=project, start_new_session=True)
    timer = threading.Timer(120, os.killpg, (agent.pid, signal.SIGKILL))
    timer.start()
    try:
        assert agent.stderr is not None
        listed = next((line for line in agent.stderr if "Available tools:" in line), "")
    finally:
        timer.cancel()
        os.killpg(agent.pid, signal.SIGKILL)
        agent.wait(10)
    tools = set(listed.split("Available tools:")[-1].strip(" .\n").split(", "))
    assert tools == {f"meshllm_{t}" for t in BOARD_TOOLS}, listed
