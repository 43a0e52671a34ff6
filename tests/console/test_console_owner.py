"""Owner control in the web console, in a real headless Chromium against real nodes started through the CLI.

alpha holds the owner keystore and serves ``tiny``; beta is certified by that owner; gamma is a
``--standby`` node with ``tiny2`` in its library. The page on alpha loads and unloads a model on
beta (a command signed with the owner key unlocked by the passphrase typed into the page), loads
one on alpha itself (the admin token is enough), and gamma's own console shows its standby card.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from console_browser import browser_session, screenshot, show_view, unlabelled_controls, wait_js
from nodes import NodeProcess, meshllm, meshllm_json, running_nodes, wait_until
from tinymodels import write_tiny_llama

from meshllm.identity.keys import NodeKey

pytestmark = pytest.mark.timeout(240)

PASSPHRASE = "console owner passphrase"
RESULT = "document.getElementById('control-result').textContent"


def listed(node: NodeProcess, model: str) -> list[str]:
    data = httpx.get(f"{node.api}/v1/models", timeout=5).json()["data"]
    return next((m["nodes"] for m in data if m["id"] == model), [])


def console_url(node: NodeProcess) -> str:
    done = meshllm("console", "--print", "--api", node.api, "--home", str(node.home), timeout=30)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def owner_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """A CLI command that needs the owner key (the nodes themselves never get the passphrase)."""
    done = subprocess.run([sys.executable, "-m", "meshllm", *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "MESHLLM_OWNER_PASSPHRASE": PASSPHRASE})
    assert done.returncode == 0, done.stderr
    return done


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("owner-console")
    models = {n: write_tiny_llama(tmp / f"{n}.gguf", seed=s) for n, s in (("tiny", 0), ("tiny2", 1))}
    alpha_home, beta_home = tmp / "alpha", tmp / "beta"
    owner_cli("auth", "init", "--home", str(alpha_home))
    owner_pub = meshllm_json("auth", "status", "--home", str(alpha_home))["owner_pub"]
    assert meshllm("auth", "trust", "add", owner_pub, "--home", str(beta_home)).returncode == 0
    signed = owner_cli("auth", "sign-node", "--home", str(alpha_home), "--json",
                       "--node-id", NodeKey.load_or_create(beta_home).node_id)
    assert meshllm("auth", "install-cert", json.loads(signed.stdout)["token"], "--home", str(beta_home)).returncode == 0
    with running_nodes() as nodes:
        alpha = NodeProcess(alpha_home, ["--model", str(models["tiny"])], "alpha")
        nodes.append(alpha)
        invite = alpha.wait_ready()["invite"]
        beta = NodeProcess(beta_home, ["--model", str(models["tiny"]), "--join", invite], "beta")
        gamma = NodeProcess(tmp / "gamma", ["--standby", "--model", str(models["tiny2"]), "--join", invite], "gamma")
        nodes += [beta, gamma]
        beta.wait_ready()
        gamma.wait_ready()
        wait_until(lambda: len(alpha.status()["peers"]) == 2, 15.0)
        yield {"alpha": alpha, "beta": beta, "gamma": gamma, "models": models}


@pytest.fixture(scope="module")
def page(mesh: dict[str, Any]) -> Iterator[Any]:
    with browser_session() as driver:
        driver.get(console_url(mesh["alpha"]))
        show_view(driver, "owner")
        wait_js(driver, "document.querySelectorAll('#control-node option').length === 3", 15, "nodes not listed")
        yield driver


def choose(page: Any, node: str, model: str) -> None:
    page.execute_script(
        "const s = document.getElementById('control-node');"
        "s.value = [...s.options].find(o => o.text.startsWith(arguments[0])).value;"
        "s.dispatchEvent(new Event('change'));"
        "document.getElementById('control-model').value = arguments[1];", node, model)


def test_a_command_to_another_node_needs_the_passphrase_and_then_runs(page: Any, mesh: dict[str, Any]) -> None:
    beta = mesh["beta"]
    assert unlabelled_controls(page) == []
    choose(page, "beta", str(mesh["models"]["tiny2"]))
    assert page.execute_script("return document.getElementById('control-passphrase').disabled") is False
    page.find_element("id", "control-load").click()
    text = wait_js(page, f"(t => t.includes('failed') && t)({RESULT})", 30, "no answer without a passphrase")
    assert "passphrase" in text  # alpha's environment has none, and the page sent none
    page.find_element("id", "control-passphrase").send_keys(PASSPHRASE)
    page.find_element("id", "control-load").click()
    wait_js(page, f"{RESULT} === 'loaded tiny2'", 60, "the load did not report success")
    wait_until(lambda: listed(mesh["alpha"], "tiny2") == [beta.node_id], 5.0)
    assert page.execute_script("return document.getElementById('control-result').className") == "result ok"
    screenshot(page, "owner-control-loaded")

    choose(page, "beta", "tiny2")
    page.find_element("id", "control-unload").click()
    wait_js(page, f"{RESULT}.startsWith('unloaded tiny2 after its requests finished')", 60, "no unload")
    wait_until(lambda: not listed(mesh["alpha"], "tiny2"), 5.0)
    assert any(e["type"] == "owner_done" and e["op"] == "unload" for e in beta.events)


def test_this_node_loads_and_unloads_with_its_admin_token(page: Any, mesh: dict[str, Any]) -> None:
    alpha = mesh["alpha"]
    choose(page, "alpha", str(mesh["models"]["tiny2"]))
    assert page.execute_script("return document.getElementById('control-passphrase').disabled") is True
    page.find_element("id", "control-load").click()
    wait_js(page, f"{RESULT}.startsWith('loaded tiny2')", 60, "the local load did not report success")
    assert listed(alpha, "tiny2") == [alpha.node_id]
    choose(page, "alpha", "tiny2")
    page.find_element("id", "control-unload").click()
    wait_js(page, f"{RESULT}.startsWith('unloaded tiny2')", 60, "the local unload did not report success")
    assert not any(e["type"] == "owner_command" for e in alpha.events)  # no owner involved


def test_a_standby_nodes_console_shows_its_standby_card(page: Any, mesh: dict[str, Any]) -> None:
    page.get(console_url(mesh["gamma"]))
    show_view(page, "models")
    text = wait_js(page, "(c => !c.hidden && c.textContent)(document.getElementById('standby-card'))", 15,
                   "no standby card on the standby's console")
    assert "library tiny2" in text and "serving nothing" in text and "No decision yet." in text
    screenshot(page, "standby-card")
