"""``meshllm launch <agent>``: run a coding agent against this node's API and a mesh model.

Each agent learns its endpoint its own way; :func:`plan` (sans-IO, so it is tested without
running anything) works out the variables and arguments, and the command then replaces itself
with the agent (``exec``), so the agent owns the terminal, its signals and its exit code:

- **claude** (Claude Code): Anthropic's Messages API at the node (``ANTHROPIC_BASE_URL``), the
  model for every tier (``ANTHROPIC_MODEL``, ``ANTHROPIC_DEFAULT_{OPUS,SONNET,HAIKU}_MODEL``),
  non-essential traffic off.
- **codex** (Codex CLI): a ``meshllm`` model provider speaking the Responses API at ``/v1``,
  passed as ``-c`` overrides (the user's ``config.toml`` is left alone), with the model's context
  window.
- **opencode**: an OpenAI-compatible provider in ``OPENCODE_CONFIG_CONTENT`` (merged over the
  user's config by opencode), the model as default and small model.
- **goose**: its OpenAI provider pointed at the node (``OPENAI_HOST``, ``OPENAI_BASE_PATH``).

Claude Code, codex and opencode also get the node's MCP server (``/mcp``: the blackboard, the
mesh's status and models, ``ask``) as a streamable-HTTP server named ``meshllm``: ``--mcp-config``
for Claude Code, an ``mcp_servers.meshllm`` override for codex (its bearer token in
``MESHLLM_MCP_TOKEN``), an ``mcp`` entry in opencode's config. ``/mcp`` needs the node's admin token
or an API key, so the agent gets the secret this command holds for the node (the API key when one
is given, else the admin token from the home); goose takes no MCP headers and gets none.

The API key (``--api-key`` / ``$MESHLLM_API_KEY``) is what the agent sends; without one a
placeholder is sent (agents insist on a key), and it replaces any real provider key in the
environment so that one never travels to the mesh. ``--print`` shows what would be set and run.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import click

from meshllm.cli.api_client import NodeApi
from meshllm.cli.common import api_option
from meshllm.errors import MeshllmError

PLACEHOLDER_KEY = "meshllm"
"""Sent when the node needs no API key: agents refuse to start without one."""
INSTALL = {"claude": "npm install -g @anthropic-ai/claude-code", "codex": "npm install -g @openai/codex",
           "opencode": "npm install -g opencode-ai", "goose": "install Block's goose CLI"}
AGENTS = tuple(sorted(INSTALL))


@dataclass(frozen=True)
class Launch:
    """What running an agent against the mesh means: its command line and the variables it gets."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)

    def shell(self) -> str:
        """The same as shell lines someone could paste."""
        lines = [f"export {name}={shlex.quote(value)}" for name, value in sorted(self.env.items())]
        return "\n".join([*lines, shlex.join(self.argv)])


MCP_NAME = "meshllm"


def plan(agent: str, api: str, model: str, *, api_key: str | None = None, context: int | None = None,
         args: Sequence[str] = (), mcp_secret: str | None = None) -> Launch:
    """The launch of ``agent`` against the node API ``api`` (no ``/v1``) serving ``model``.

    ``mcp_secret``: the secret ``/mcp`` accepts (None: the agent gets no MCP server).
    """
    key = api_key or PLACEHOLDER_KEY
    mcp_url = api + "/mcp"
    bearer = {"Authorization": f"Bearer {mcp_secret}"}
    if agent == "claude":
        tiers = {f"ANTHROPIC_DEFAULT_{tier}_MODEL": model for tier in ("OPUS", "SONNET", "HAIKU")}
        servers = {"mcpServers": {MCP_NAME: {"type": "http", "url": mcp_url, "headers": bearer}}}
        # last: --mcp-config takes several values, and would swallow a prompt that followed it
        mcp = ["--mcp-config", json.dumps(servers)] if mcp_secret else []
        return Launch(["claude", *args, *mcp], {
            "ANTHROPIC_BASE_URL": api, "ANTHROPIC_AUTH_TOKEN": key, "ANTHROPIC_API_KEY": key,
            "ANTHROPIC_MODEL": model, "ANTHROPIC_SMALL_FAST_MODEL": model, **tiers,
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"})
    if agent == "codex":
        provider = (f"model_providers.meshllm={{ name = \"meshllm\", base_url = {json.dumps(api + '/v1')}, "
                    f"env_key = \"MESHLLM_API_KEY\", wire_api = \"responses\" }}")
        window = ["-c", f"model_context_window={context}"] if context else []
        mcp = ["-c", f"mcp_servers.{MCP_NAME}={{ url = {json.dumps(mcp_url)}, "
                     f"bearer_token_env_var = \"MESHLLM_MCP_TOKEN\" }}"] if mcp_secret else []
        return Launch(["codex", "-c", provider, "-c", "model_provider=meshllm", *window, *mcp, "-m", model, *args],
                      {"MESHLLM_API_KEY": key, **({"MESHLLM_MCP_TOKEN": mcp_secret} if mcp_secret else {})})
    if agent == "opencode":
        # opencode compacts the conversation whenever input + output could overflow context - output:
        # an output limit equal to the context compacted after every turn, forever (seen with a 4K model).
        limits: dict[str, Any] = {"limit": {"context": context, "output": min(context // 4, 4096)}} if context else {}
        config = {"$schema": "https://opencode.ai/config.json",
                  "provider": {"meshllm": {"npm": "@ai-sdk/openai-compatible", "name": "meshllm",
                                           "options": {"baseURL": api + "/v1", "apiKey": key},
                                           "models": {model: {"name": model, **limits}}}},
                  "model": f"meshllm/{model}", "small_model": f"meshllm/{model}"}
        if mcp_secret:
            config["mcp"] = {MCP_NAME: {"type": "remote", "url": mcp_url, "headers": bearer, "enabled": True}}
        return Launch(["opencode", *args], {"OPENCODE_CONFIG_CONTENT": json.dumps(config)})
    if agent == "goose":
        return Launch(["goose", *(args or ["session"])], {
            "GOOSE_PROVIDER": "openai", "GOOSE_MODEL": model, "OPENAI_HOST": api,
            "OPENAI_BASE_PATH": "v1/chat/completions", "OPENAI_API_KEY": key})
    raise MeshllmError(f"unknown agent {agent!r}", hint=f"choose one of {', '.join(AGENTS)}")


def mesh_model(api: NodeApi, wanted: str | None) -> tuple[str, int | None]:
    """The model to use (``wanted``, else the mesh's first) and its context length, from ``/v1/models``."""
    listing = api.get_json("/v1/models")["data"]
    if not listing:
        raise MeshllmError(f"the node at {api} has no model to offer yet",
                           hint="start a node with `meshllm serve --model REF`, or wait until its model is loaded")
    for entry in listing:
        if wanted is None or entry["id"] == wanted:
            return str(entry["id"]), entry.get("context_length")
    raise MeshllmError(f"model {wanted!r} is not served by this mesh",
                       hint=f"`meshllm models --api {api}` lists them: {', '.join(e['id'] for e in listing)}")


@click.command("launch", context_settings={"ignore_unknown_options": True})
@click.argument("agent", type=click.Choice(AGENTS))
@click.argument("agent_args", nargs=-1, type=click.UNPROCESSED)
@api_option
@click.option("--model", default=None, metavar="ID", help="The mesh model to use (default: the first listed).")
@click.option("--print", "print_only", is_flag=True, help="Print the variables and the command instead of running.")
def launch(agent: str, agent_args: tuple[str, ...], api: NodeApi, model: str | None, print_only: bool) -> None:
    """Run a coding agent (claude, codex, opencode, goose) on this node's API and a mesh model.

    Arguments launch does not know go to the agent; put them after ``--`` when they clash with
    launch's own options, e.g. meshllm launch claude --model m -- -p "hello".
    """
    chosen, context = mesh_model(api, model)
    # The agent's model calls get the node's API key when one was given, never the admin token read from the
    # home; its MCP server needs a secret that /mcp accepts, which is whichever this command holds.
    api_key = api.secret if api.source == "--api-key" else None
    job = plan(agent, api.url, chosen, api_key=api_key, context=context, args=agent_args, mcp_secret=api.secret)
    if print_only:
        click.echo(job.shell())
        return
    binary = shutil.which(job.argv[0])
    if binary is None:
        raise MeshllmError(f"{job.argv[0]} is not installed (not found on PATH)", hint=INSTALL[agent])
    os.execvpe(binary, job.argv, {**os.environ, **job.env})
