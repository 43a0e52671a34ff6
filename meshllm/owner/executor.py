"""What each owner command does on the node it reached (after ``owner/policy.py`` admitted it).

- ``load MODEL``: load it while serving (``Serving.load_model``); the peer record announces it, so
  every node lists it within a gossip round. Loading what is served already is a success that says so.
- ``unload MODEL``: take it out of routing, let its requests finish (up to the command's timeout),
  free it (``Serving.unload_model``).
- ``drain``: unload every model this node loaded, each drained the same way, and pause its standby
  controller so it does not load them back; ``config standby=on`` resumes it.
- ``config KEY=VALUE``: change a runtime setting (:data:`SETTINGS`); settings live until the node
  restarts (``meshllm serve`` options and ``config.toml`` set them at start).
- ``status``: the node's serving state, standby decisions and own demand.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from meshllm.errors import ConfigError
from meshllm.owner.commands import OwnerCommand
from meshllm.owner.standby import StandbyDriver
from meshllm.runtime.serving import Serving, in_flight

SETTINGS: dict[str, str] = {
    "name": "the node's name, as peers and the console show it (1-64 characters)",
    "standby": "on or off: whether a standby node takes wanted models from its standby library",
    "standby_idle_s": "seconds without a request before a model a standby took is unloaded (1-86400)",
}


@dataclass
class Executor:
    """Runs admitted commands against this node's parts."""

    serving: Serving
    standby: StandbyDriver | None
    rename: Callable[[str], None]
    """Set the node's name (its record and status)."""
    describe: Callable[[], dict[str, Any]]
    """Facts about the node for ``status`` (id, name, version, certificate)."""

    async def run(self, command: OwnerCommand) -> tuple[str, dict[str, Any]]:
        """``(message, data)`` for ``command``; a :class:`~meshllm.errors.MeshllmError` says why it failed."""
        if command.op == "load":
            return await self.load(command.model, command.timeout_s)
        if command.op == "unload":
            result = await self.serving.unload_model(command.model, command.timeout_s)
            return _unloaded(result), result
        if command.op == "drain":
            return await self.drain(command.timeout_s)
        if command.op == "config":
            return self.configure(command.key, command.value)
        return "status", self.status()

    async def load(self, spec: str, timeout_s: float) -> tuple[str, dict[str, Any]]:
        """Load ``spec``; past the timeout the load goes on and the answer says so."""
        task = asyncio.ensure_future(self.serving.load_model(spec))
        try:
            engine, fresh = await asyncio.wait_for(asyncio.shield(task), timeout=timeout_s)
        except TimeoutError:
            raise ConfigError(f"{spec} is still loading after {timeout_s:g} s",
                              hint="it is served as soon as it is loaded; check with `meshllm owner NODE status`") \
                from None
        data = {"model": engine.model_id, "engine": self.serving.loaded[engine.model_id],
                "context": engine.context_length, "loaded": fresh}
        return (f"loaded {engine.model_id}" if fresh else f"{engine.model_id} was already served"), data

    async def drain(self, timeout_s: float) -> tuple[str, dict[str, Any]]:
        """Unload every model loaded here, concurrently, and pause the standby controller."""
        if self.standby is not None:
            self.standby.controller.enabled = False
        models = list(self.serving.loaded)
        results = await asyncio.gather(*(self.serving.unload_model(m, timeout_s) for m in models))
        cancelled = sum(r["cancelled"] for r in results)
        message = f"drained {len(results)} model{'s' if len(results) != 1 else ''}" + \
            (f" ({cancelled} requests cancelled at the deadline)" if cancelled else "")
        return message, {"unloaded": results, "standby_paused": self.standby is not None}

    def configure(self, key: str, value: str) -> tuple[str, dict[str, Any]]:
        """Apply one setting now (until the node restarts)."""
        value = value.strip()
        if key == "name":
            if not 1 <= len(value) <= 64 or not value.isprintable():
                raise ConfigError("a name has 1-64 printable characters")
            self.rename(value)
        elif key == "standby":
            if self.standby is None:
                raise ConfigError("this node has no standby library", hint="start it with `meshllm serve --standby`")
            if value not in ("on", "off"):
                raise ConfigError(f"standby is on or off, not {value[:20]!r}")
            self.standby.controller.enabled = value == "on"
        elif key == "standby_idle_s":
            if self.standby is None:
                raise ConfigError("this node has no standby library", hint="start it with `meshllm serve --standby`")
            try:
                seconds = float(value)
            except ValueError:
                raise ConfigError(f"standby_idle_s is a number of seconds, not {value[:20]!r}") from None
            if not math.isfinite(seconds) or not 1 <= seconds <= 86400:
                raise ConfigError("standby_idle_s is between 1 and 86400 seconds")
            self.standby.set_idle(seconds)
        else:
            known = ", ".join(f"{k} ({v})" for k, v in SETTINGS.items())
            raise ConfigError(f"unknown setting {key[:64]!r}", hint=f"settings: {known}")
        return f"{key} = {value}", {"key": key, "value": value}

    def status(self) -> dict[str, Any]:
        """The node's serving state, standby controller and own demand."""
        now = time.time()
        models = []
        for model, kind in sorted(self.serving.loaded.items()):
            report = self.serving.engines[model].load_report()
            entry = {"model": model, "engine": kind, "running": report.running, "queued": report.queued,
                     "tok_s": report.tokens_per_s, "standby": False}
            if self.standby is not None and model in self.standby.controller.promoted:
                used = self.standby.last_used.get(model, now)
                entry.update(standby=True, idle_s=round(now - used, 1))
            models.append(entry)
        draining = [{"model": m, "in_flight": in_flight(e)} for m, e in sorted(self.serving.draining.items())]
        return {**self.describe(), "models": models, "draining": draining,
                "standby": self.standby.controller.status(now) if self.standby is not None else None}


def _unloaded(result: dict[str, Any]) -> str:
    if result["drained"]:
        return f"unloaded {result['model']} after its requests finished ({result['waited_s']:g} s)"
    return f"unloaded {result['model']}; {result['cancelled']} requests were still running and were cancelled"
