"""The web console in a real headless Chromium against a real 3-node mesh started through the CLI.

alpha owns the mesh and coordinates a 2-stage split of a 6-layer tiny model; beta serves a 2-layer
tiny model whole; gamma is a ``--worker`` that hosts alpha's second stage. The browser opens
alpha's console (the URL ``meshllm console --print`` gives, with the admin token in the fragment)
*before* beta and gamma start, so the page must show them joining without a reload. The tests then
walk the page as a user would, in order: the map and the 3x3 RTT matrix, the models view with the
split chain, a chat streamed into the page, an invite created, copied and revoked, publishing, the
read-only page without a token, keyboard use, and gamma killed and gone from the map within 5 s.
Every state is saved as screenshots (1280x800 and 390 px wide, light and dark) in
``tests/console/results/``.

The node's management routes demand the admin token; the page sends the one it took from the
fragment, and a page without it is read-only.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from console_browser import (
    PHONE,
    browser_session,
    contrast_failures,
    screenshot,
    sent_headers,
    set_theme,
    set_viewport,
    show_view,
    unlabelled_controls,
    wait_js,
)
from nodes import NodeProcess, meshllm, meshllm_json, running_nodes, wait_until
from tinymodels import write_tiny_llama

from meshllm.config import ADMIN_TOKEN_FILE

pytestmark = pytest.mark.timeout(240)

NODE_COUNT = "document.querySelectorAll('#map g.node').length"


@dataclass
class Mesh:
    alpha: NodeProcess
    beta: NodeProcess | None = None
    gamma: NodeProcess | None = None
    token: str = ""
    """alpha's admin token."""


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("models")
    return {"tiny": write_tiny_llama(folder / "tiny.gguf", seed=0),
            "tiny6": write_tiny_llama(folder / "tiny6.gguf", n_layers=6, seed=3)}


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory, models: dict[str, Path]) -> Iterator[Mesh]:
    """alpha only; the ``console`` fixture starts the others once the page is open."""
    tmp = tmp_path_factory.mktemp("mesh")
    with running_nodes() as nodes:
        alpha = NodeProcess(tmp / "alpha", ["--model", str(models["tiny6"]), "--split", "force", "--stages", "2"],
                            "alpha")
        nodes.append(alpha)
        alpha.wait_ready()
        yield Mesh(alpha, token=(alpha.home / ADMIN_TOKEN_FILE).read_text().strip())
        for node in nodes[1:]:
            node.kill()


def join(mesh: Mesh, tmp: Path, models: dict[str, Path]) -> None:
    invite = mesh.alpha.ready["invite"]
    mesh.beta = NodeProcess(tmp / "beta", ["--model", str(models["tiny"]), "--join", invite], "beta")
    mesh.gamma = NodeProcess(tmp / "gamma", ["--worker", "--join", invite], "gamma")
    mesh.beta.wait_ready()
    mesh.gamma.wait_ready()


@pytest.fixture(scope="module")
def console(mesh: Mesh, models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A browser on alpha's console, opened from ``meshllm console --print``, with beta and gamma joining after."""
    with browser_session() as driver:
        done = meshllm("console", "--print", "--api", mesh.alpha.api, "--home", str(mesh.alpha.home), timeout=30)
        assert done.returncode == 0, done.stderr
        driver.get(done.stdout.strip())
        wait_js(driver, f"{NODE_COUNT} === 1", 15, "the page never drew alpha")
        driver.execute_script("window.__sameDocument = true")
        join(mesh, tmp_path_factory.mktemp("joiners"), models)
        yield driver
        for node in (mesh.beta, mesh.gamma):
            if node is not None:
                node.kill()


def shots(driver: Any, name: str, phone: bool = True) -> None:
    """Screenshots of the current view: desktop and (optionally) phone, light and dark; contrast checked in each."""
    for theme in ("light", "dark"):
        set_theme(driver, theme)
        for size, label in [((1280, 800), "1280"), *([(PHONE, "390")] if phone else [])]:
            screenshot(driver, f"{name}-{label}-{theme}", size)
            assert driver.execute_script("return document.documentElement.scrollWidth") <= size[0] + 1, \
                f"{name} scrolls sideways at {label} px ({theme})"
        set_viewport(driver, (1280, 800))
        assert contrast_failures(driver) == [], f"low contrast in {name} ({theme})"
    set_theme(driver, "auto")


def test_the_map_shows_all_three_nodes_and_the_rtt_matrix_without_a_reload(console: Any, mesh: Mesh) -> None:
    show_view(console, "mesh")
    wait_js(console, f"{NODE_COUNT} === 3", 20, "the map never showed beta and gamma joining")
    mesh.alpha.wait_event(lambda e: e["type"] == "split_ready", 60)  # alpha announces tiny6 once its chain stands
    # Records spread by gossip: wait until the map shows what every node announced.
    wait_js(console, "(l => l.length === 3 && l[0].includes('tiny6') && l.some(x => x.startsWith('beta; host; tiny;')))"
                     "([...document.querySelectorAll('#map g.node')].map(g => g.ariaLabel))", 15,
            "the map does not show the nodes' models")
    assert console.execute_script("return window.__sameDocument"), "the page reloaded"
    names = console.execute_script("return [...document.querySelectorAll('#map g.node')].map(g => [g.dataset.nodeId,"
                                   " g.querySelector('.name').textContent, g.getAttribute('aria-label')])")
    assert [n[:2] for n in names] == [[mesh.alpha.node_id, "alpha"], *sorted(
        [[mesh.beta.node_id, "beta"], [mesh.gamma.node_id, "gamma"]], key=lambda n: n[1])]
    labels = {n[1]: n[2] for n in names}
    assert "alpha (this node); host" in labels["alpha"] and "tiny6 [0–" in labels["alpha"]
    assert labels["beta"].startswith("beta; host; tiny;")
    assert "gamma; worker" in labels["gamma"]
    assert "RAM" in labels["beta"] and "tok/s" in labels["beta"]

    cells = wait_js(console, "(() => { const c = [...document.querySelectorAll('#rtt-matrix td.heat')]; return"
                             " c.length === 6 && c.map(td => [td.dataset.from, td.dataset.to, td.textContent]); })()",
                    20, "the RTT matrix never filled its 6 cells")
    ids = {mesh.alpha.node_id, mesh.beta.node_id, mesh.gamma.node_id}
    assert {(a, b) for a, b, _ in cells} == {(a, b) for a in ids for b in ids if a != b}
    assert all(float(text) > 0 for _, _, text in cells)
    assert console.execute_script("return document.querySelectorAll('#rtt-matrix tbody tr').length") == 3
    links = wait_js(console, "(() => { const l = [...document.querySelectorAll('#map g.link')];"
                             " return l.length === 3 && l.map(g => g.dataset.path); })()", 20,
                    "the map never drew the 3 links")
    assert links == ["direct"] * 3

    # The token from the URL fragment left the address bar, stayed in the tab, and rides on every call.
    assert "admin=" not in console.current_url
    assert console.execute_script("return sessionStorage.getItem('meshllm.token')") == mesh.token
    headers = sent_headers(console, "/api/status")
    assert headers and all(h.get("authorization") == f"Bearer {mesh.token}" for h in headers)
    assert unlabelled_controls(console) == []
    shots(console, "mesh")


def test_the_status_has_the_fields_the_console_draws(console: Any, mesh: Mesh) -> None:
    status = httpx.get(mesh.alpha.api + "/api/status", headers=auth(mesh.token), timeout=5).json()
    assert status["mesh_owner"] is True
    assert set(status["capacity"]) == {"ram_bytes", "vram_bytes", "cpu_cores", "gflops"}
    assert set(status["load"]) == {"in_flight", "queue", "tok_s", "slots", "free_slots"}
    ids = {status["node_id"], *(p["node_id"] for p in status["peers"] if p["state"] == "alive")}
    assert all(link["a"] in ids and link["b"] in ids and link["a"] < link["b"] for link in status["links"])
    assert all(link["path"] in ("direct", "punched", "relayed") and link["rtt_ms"] > 0 for link in status["links"])
    assert len(status["links"]) == 3


def test_the_models_view_shows_where_each_model_runs_and_the_split_chain(console: Any, mesh: Mesh) -> None:
    mesh.alpha.wait_event(lambda e: e["type"] == "split_ready", 60)
    (split,) = httpx.get(mesh.alpha.api + "/api/status", headers=auth(mesh.token), timeout=5).json()["splits"]
    (a0, a1), (g0, g1) = (stage["layers"] for stage in split["stages"])  # the planner chose the boundary
    assert [stage["name"] for stage in split["stages"]] == ["alpha", "gamma"] and a0 == 0 and a1 == g0 and g1 == 6
    show_view(console, "models")
    row = ("(() => { const r = document.querySelector('#models-table tr[data-model=\"tiny6\"]');"
           " return r && [...r.querySelectorAll('.chip')].map(c => c.textContent); })()")
    chips = wait_js(console, f"{row}?.length === 2 && {row}", 20, "tiny6 never showed its coordinator and stage")
    assert chips == [f"alpha · split coordinator [0–{a1}) (this node)", f"gamma · stage [{g0}–6)"]
    tiny = console.execute_script("return [...document.querySelectorAll('#models-table tr[data-model=\"tiny\"] .chip')]"
                                  ".map(c => c.textContent)")
    assert tiny == ["beta · llama"]
    chain = wait_js(console, "(() => { const s = [...document.querySelectorAll('#splits .chain[data-model=\"tiny6\"]"
                             " .stage')]; return s.length === 2 && s.map(x => x.textContent); })()", 10,
                    "the chain is not drawn")
    assert chain == [f"stage 0alpha[0–{a1})", f"stage 1gamma[{g0}–6)"]
    heading = console.execute_script("return document.querySelector('#splits .chain p').textContent")
    assert "coordinated here · ready" in heading

    # Transfers and demand: shown only when the node reports them, never made up.
    status = httpx.get(mesh.alpha.api + "/api/status", headers=auth(mesh.token), timeout=5).json()
    for key in ("transfers", "demand"):
        hidden = console.execute_script(f"return document.getElementById('{key}-card').hidden")
        assert hidden == (key not in status), key
    shots(console, "models")


def test_a_chat_streams_text_into_the_page(console: Any, mesh: Mesh) -> None:
    show_view(console, "chat")
    wait_js(console, "[...document.getElementById('chat-model').options].map(o => o.value).sort().join()"
                     " === 'auto,tiny,tiny6'", 15, "the model picker does not list the mesh's models and auto")
    before = httpx.get(mesh.beta.api + "/api/status", headers=auth(mesh.token), timeout=5).json()["requests"]
    console.execute_script("""
        const form = document.getElementById('chat-form');
        form.elements.namedItem('model').value = 'tiny';
        form.elements.namedItem('temperature').value = '0';
        form.elements.namedItem('max_tokens').value = '48';
        window.__appends = [];
        // Every delta replaces the reply's text node; record the length of each text the page showed.
        new MutationObserver(records => { for (const r of records)
            for (const n of r.addedNodes) if (n.nodeType === 3 && r.target.closest('.msg.assistant'))
              window.__appends.push(n.data.length); })
          .observe(document.getElementById('chat-log'), { childList: true, subtree: true });
    """)
    box = console.find_element("id", "chat-input")
    box.send_keys("Tell me about meshes")
    box.send_keys("\n")  # Enter sends
    finish = wait_js(console, "document.querySelector('.msg.assistant')?.dataset.finish", 60,
                     "the reply never finished")
    appends = console.execute_script("return window.__appends")
    text = console.execute_script("return document.querySelector('.msg.assistant .content').textContent")
    meta = console.execute_script("return document.querySelector('.msg.assistant .meta').textContent")
    print(f"chat: {len(appends)} appends, {len(text)} characters, finish {finish}; {meta}")
    assert finish in ("stop", "length") and text
    assert len(appends) >= 3 and appends == sorted(appends) and appends[-1] == len(text), appends
    assert "tokens" in meta and "first token after" in meta
    assert console.execute_script("return document.querySelector('.msg.user .content').textContent") \
        == "Tell me about meshes"
    # alpha serves no whole "tiny": the page's request was routed over the mesh to beta.
    after = httpx.get(mesh.beta.api + "/api/status", headers=auth(mesh.token), timeout=5).json()["requests"]
    assert after["served_for_peers"] == before["served_for_peers"] + 1
    shots(console, "chat")


def test_the_owner_creates_copies_and_revokes_an_invite(console: Any, mesh: Mesh) -> None:
    show_view(console, "owner")
    wait_js(console, "!document.getElementById('invite-create').disabled", 10, "Create invite stays disabled")
    console.execute_cdp_cmd("Browser.grantPermissions", {
        "permissions": ["clipboardReadWrite", "clipboardSanitizedWrite"], "origin": mesh.alpha.api})
    console.execute_script("document.getElementById('invite-uses').value = '2'")
    console.find_element("id", "invite-create").click()
    invite_id = wait_js(console, "document.querySelector('#invites li.invite')?.dataset.inviteId", 10,
                        "no invite appeared")
    token = console.execute_script("return document.querySelector('#invites li.invite input.token').value")
    info = meshllm_json("invite", "inspect", token)
    assert info["invite_id"] == invite_id and info["mesh_id"] == mesh.alpha.ready["mesh_id"] and info["max_uses"] == 2
    assert f"Invite {invite_id} created." in console.find_element("id", "owner-result").text

    console.execute_script("document.querySelector('#invites li.invite button.copy').focus()")
    console.switch_to.active_element.click()
    wait_js(console, "document.querySelector('#invites li.invite').textContent.includes('Copied.')", 5, "copy failed")
    copied = console.execute_async_script("const done = arguments[0];"
                                          " navigator.clipboard.readText().then(done, e => done(String(e)))")
    assert copied == token
    shots(console, "invite-created")

    console.execute_script("document.querySelector('#invites li.invite button.danger').click()")
    alert = console.switch_to.alert
    assert invite_id in alert.text
    alert.accept()
    wait_js(console, "document.querySelector('#invites li.invite').classList.contains('revoked')", 10,
            "the invite was not marked revoked")
    assert f"Revoked invite {invite_id}." in console.find_element("id", "owner-result").text
    mesh.alpha.wait_event(lambda e: e["type"] == "revoked" and e.get("target") == invite_id, 10)
    shots(console, "invite-revoked", phone=False)


def test_the_owner_publishes_and_unpublishes_the_mesh(console: Any, mesh: Mesh) -> None:
    pytest.importorskip("libp2p", reason="publishing needs the DHT (libp2p, in the dev extra)")
    show_view(console, "owner")
    console.execute_script("document.getElementById('publish-name').value = 'console-demo'")
    console.find_element("id", "publish-on").click()
    wait_js(console, "document.getElementById('publish-state').dataset.published === 'true'", 30, "publish failed")
    assert "console-demo" in console.find_element("id", "publish-state").text
    assert httpx.get(mesh.alpha.api + "/api/publish", headers=auth(mesh.token), timeout=5).json()["published"]
    console.find_element("id", "publish-off").click()
    wait_js(console, "document.getElementById('publish-state').dataset.published === 'false'", 30, "unpublish failed")
    assert not httpx.get(mesh.alpha.api + "/api/publish", headers=auth(mesh.token), timeout=5).json()["published"]


def test_without_a_token_management_is_off_and_says_why(console: Any, mesh: Mesh) -> None:
    show_view(console, "owner")
    console.find_element("id", "token-forget").click()
    note = wait_js(console, "(n => !n.hidden && n.textContent)(document.getElementById('owner-note'))", 5,
                   "no reason shown")
    assert "Read-only" in note and "token" in note
    disabled = console.execute_script("return ['invite-create', 'revoke-submit', 'publish-on', 'publish-off']"
                                      ".map(id => document.getElementById(id).disabled)")
    assert disabled == [True] * 4
    assert console.execute_script("return [...document.querySelectorAll('#members button')].every(b => b.disabled)")
    assert console.execute_script("return sessionStorage.getItem('meshllm.token')") is None
    shots(console, "read-only", phone=False)

    field = console.find_element("id", "token-input")
    field.send_keys(mesh.token)
    field.send_keys("\n")
    wait_js(console, "!document.getElementById('invite-create').disabled", 5,
            "the pasted token did not enable management")
    assert console.execute_script("return sessionStorage.getItem('meshllm.token')") == mesh.token


def test_keyboard_reaches_the_tabs_and_the_map_with_a_visible_focus(console: Any) -> None:
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.keys import Keys

    show_view(console, "mesh")
    console.execute_script("document.activeElement.blur(); window.scrollTo(0, 0)")
    keys = ActionChains(console)
    focused = []
    for _ in range(6):
        keys.send_keys(Keys.TAB).perform()
        focused.append(console.execute_script(
            "const a = document.activeElement; return a.id || a.className.baseVal || a.className"))
    # The skip link, the theme button, the selected tab only (arrows move between tabs), then the map's nodes.
    stops = [f for f in focused if f]
    assert stops[:3] == ["skip", "theme", "tab-mesh"] and stops[3].startswith("node "), focused
    console.execute_script("document.getElementById('tab-mesh').focus()")
    keys.send_keys(Keys.ARROW_RIGHT).perform()
    assert console.execute_script("return document.activeElement.id") == "tab-models"
    assert console.execute_script("return document.getElementById('tab-models').ariaSelected") == "true"
    assert not console.execute_script("return document.getElementById('view-models').hidden")
    outline = console.execute_script("return getComputedStyle(document.activeElement).outlineStyle")
    assert outline == "solid", "the focused tab shows no focus ring"
    keys.send_keys(Keys.ARROW_LEFT).perform()
    # Tab on from the tab list into the map: every node is a stop, and keeps the focus across redraws.
    for _ in range(20):
        keys.send_keys(Keys.TAB).perform()
        if console.execute_script("return document.activeElement.matches('#map g.node')"):
            break
    else:
        raise AssertionError("Tab never reached a node of the map")
    node = console.execute_script("return document.activeElement.dataset.nodeId")
    time.sleep(2.5)  # two status polls redraw the map
    assert console.execute_script("return document.activeElement.dataset.nodeId") == node


def test_a_killed_node_leaves_the_map_within_5_s(console: Any, mesh: Mesh) -> None:
    show_view(console, "mesh")
    assert mesh.gamma is not None
    gone = f"!document.querySelector('#map g.node[data-node-id=\"{mesh.gamma.node_id}\"]')"
    assert not console.execute_script(f"return {gone}")
    mesh.gamma.kill()
    took = wait_until(lambda: console.execute_script(f"return {gone}"), 15.0, interval=0.05)
    print(f"killed node left the map {took:.2f} s after SIGKILL")
    assert took < 5.0
    assert console.execute_script(f"return {NODE_COUNT}") == 2
    wait_js(console, "document.querySelectorAll('#rtt-matrix tbody tr').length === 2", 5, "the matrix kept gamma")
    assert "gamma" in console.find_element("id", "gone").text
    assert console.execute_script("return window.__sameDocument"), "the page reloaded"
    shots(console, "after-kill", phone=False)


def test_a_members_console_sends_management_to_the_owners_node(console: Any, mesh: Mesh) -> None:
    assert mesh.beta is not None
    console.get(mesh.beta.api + "/#owner")
    note = wait_js(console, "(n => !n.hidden && n.textContent)(document.getElementById('owner-note'))", 10,
                   "no reason shown on a member's node")
    assert "does not hold the mesh key" in note
    assert console.execute_script("return document.getElementById('invite-create').disabled")
    assert "beta (host)" in console.find_element("id", "summary").text


def test_a_node_that_stops_answering_is_reported_and_retried(console: Any, mesh: Mesh) -> None:
    assert mesh.beta is not None
    console.get(mesh.beta.api + "/#mesh")
    wait_js(console, f"document.getElementById('link').dataset.state === 'live' && {NODE_COUNT} === 2", 10,
            "beta's console does not show beta and alpha live")
    mesh.beta.kill()
    wait_js(console, "document.getElementById('link').textContent === 'node not answering'", 10,
            "the header does not say the node stopped answering")
    banner = wait_js(console, "(b => !b.hidden && b.textContent)(document.getElementById('banner'))", 5, "no banner")
    assert "not answering" in banner and "retrying" in banner
    assert console.execute_script(f"return {NODE_COUNT}") >= 1, "the last known map was wiped"
    screenshot(console, "node-stopped-1280")


def test_console_command_opens_the_default_browser_with_the_token(mesh: Mesh, tmp_path: Path) -> None:
    """``meshllm console`` hands the URL to the user's browser ($BROWSER here: a script that records it)."""
    record = tmp_path / "opened.txt"
    opener = tmp_path / "open-url"
    opener.write_text(f"#!{sys.executable}\nimport pathlib, sys\n"
                      f"pathlib.Path({str(record)!r}).write_text(sys.argv[1])\n")
    opener.chmod(0o755)
    env = {**os.environ, "BROWSER": f"{opener} %s"}
    done = subprocess.run([sys.executable, "-m", "meshllm", "console", "--api", mesh.alpha.api,
                           "--home", str(mesh.alpha.home)], capture_output=True, text=True, timeout=30, env=env)
    assert done.returncode == 0, done.stderr
    assert "opened the console" in done.stdout and mesh.token not in done.stdout
    wait_until(record.exists, 10.0)
    assert record.read_text() == f"{mesh.alpha.api}/#admin={mesh.token}"


def test_console_print_needs_a_node_that_serves_the_console(mesh: Mesh) -> None:
    done = meshllm("console", "--print", "--api", mesh.alpha.api + "/v1", "--home", str(mesh.alpha.home))
    assert done.returncode == 1 and "serves no meshllm console" in done.stderr
    # An explicit token wins over the home's (e.g. an API key for the page to send).
    done = meshllm("console", "--print", "--api", mesh.alpha.api, "--api-key", "key with/odd=chars")
    assert done.returncode == 0 and done.stdout.strip() == f"{mesh.alpha.api}/#admin=key%20with%2Fodd%3Dchars"
