"""Management calls need authority: a real node, real HTTP clients, a real browser.

Findings reproduced (each failed on the original main): ``POST /api/invite`` (a join token),
``/api/revoke`` (eject nodes) and ``/api/publish`` (make a private mesh public) answered any local
process, with any ``Host`` header, so a DNS-rebinding page could reach them too.
"""

from __future__ import annotations

import http.server
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from nodes import NodeProcess, meshllm, running_nodes

from meshllm.identity.keys import NodeKey

pytestmark = pytest.mark.timeout(120)

SOME_NODE = NodeKey.ephemeral().node_id
MANAGEMENT = [
    ("POST", "/api/invite", {"ttl_s": 3600, "max_uses": 0}),
    ("POST", "/api/revoke", {"kind": "node", "target": SOME_NODE}),
    ("POST", "/api/publish", {"name": "stolen"}),
    ("DELETE", "/api/publish", None),
]


@pytest.fixture(scope="module")
def owner(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    with running_nodes() as nodes:
        nodes.append(NodeProcess(tmp_path_factory.mktemp("auth") / "owner", ["--client"], "owner"))
        nodes[0].wait_ready()
        yield nodes[0]


def call(node: NodeProcess, method: str, path: str, body: object = None, **headers: str) -> httpx.Response:
    return httpx.request(method, node.api + path, json=body, headers=headers, timeout=10)


@pytest.mark.parametrize(("method", "path", "body"), MANAGEMENT)
def test_management_routes_refuse_callers_without_a_valid_secret(owner: NodeProcess, method: str, path: str,
                                                                 body: object) -> None:
    for headers in ({}, {"authorization": "Bearer not-the-token-0123456789"}, {"x-api-key": "not-the-token-01234"},
                    {"authorization": f"Basic {owner.admin_token}"}):
        answer = call(owner, method, path, body, **headers)
        assert answer.status_code == 401, (headers, answer.text)
        assert answer.json()["error"]["code"] == "invalid_api_key"
        assert answer.headers["www-authenticate"].startswith("Bearer")
    assert owner.status()["peers"] == []
    published = call(owner, "GET", "/api/publish", authorization=f"Bearer {owner.admin_token}").json()
    assert not published["published"], "the refused calls changed nothing"


def test_the_admin_token_is_accepted_as_bearer_and_as_x_api_key(owner: NodeProcess) -> None:
    body = {"ttl_s": 60, "max_uses": 1}
    for headers in ({"authorization": f"Bearer {owner.admin_token}"}, {"x-api-key": owner.admin_token}):
        answer = call(owner, "POST", "/api/invite", body, **headers)
        assert answer.status_code == 200 and answer.json()["token"]


def test_the_cli_sends_the_token_of_the_home_it_is_given(owner: NodeProcess, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHLLM_HOME", str(tmp_path / "someone-else"))
    refused = meshllm("invite", "create", "--api", owner.api)
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    assert "refused /api/invite" in refused.stderr and "admin token" in refused.stderr and "--home" in refused.stderr
    wrong = meshllm("invite", "create", "--api", owner.api, "--api-key", "w" * 24)
    assert wrong.returncode == 1 and "not valid" in wrong.stderr
    made = meshllm("invite", "create", *owner.api_args)
    assert made.returncode == 0 and len(made.stdout.strip()) > 40, made.stderr
    monkeypatch.setenv("MESHLLM_HOME", str(owner.home))
    assert meshllm("invite", "create", "--api", owner.api).returncode == 0, "$MESHLLM_HOME works as --home"


@pytest.mark.parametrize("host", ["evil.example", "evil.example:1234", "rebind.attacker.test", "localhost.evil"])
def test_a_foreign_host_header_is_refused_dns_rebinding(owner: NodeProcess, host: str) -> None:
    token = {"authorization": f"Bearer {owner.admin_token}"}
    for method, path, body in [("GET", "/api/status", None), ("GET", "/v1/models", None), *MANAGEMENT[:1]]:
        answer = call(owner, method, path, body, host=host, **token)
        assert answer.status_code == 403, (host, path, answer.text)
        assert answer.json()["error"]["code"] == "host_not_allowed"


def test_loopback_names_and_ip_literals_are_served(owner: NodeProcess) -> None:
    port = owner.api.rsplit(":", 1)[1]
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", "LOCALHOST", f"[::1]:{port}", "10.1.2.3:80"):
        assert call(owner, "GET", "/api/status", host=host).status_code == 200, host


def test_a_foreign_origin_cannot_change_anything_even_with_the_token(owner: NodeProcess) -> None:
    token = {"authorization": f"Bearer {owner.admin_token}"}
    body = {"ttl_s": 60}
    refused = call(owner, "POST", "/api/invite", body, origin="https://evil.example", **token)
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "origin_not_allowed"
    assert call(owner, "POST", "/api/invite", body, origin="null", **token).status_code == 403
    for origin in ("http://localhost:3000", "http://127.0.0.1:8080", owner.api):
        assert call(owner, "POST", "/api/invite", body, origin=origin, **token).status_code == 200, origin


# --- a real browser ----------------------------------------------------------------------------------------

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")

PAGE = """<html><body><script>
const node = %(node)r, token = %(token)r, out = {};
async function probe(name, url, init) {
  try { const r = await fetch(url, init); out[name] = r.type === "opaque" ? "opaque" : String(r.status); }
  catch (e) { out[name] = "blocked"; }
}
(async () => {
  await probe("status", node + "/api/status");
  await probe("invite_json", node + "/api/invite", {method: "POST", headers: {"content-type": "application/json"},
                                                    body: '{"ttl_s": 60}'});
  await probe("publish_no_cors", node + "/api/publish", {method: "POST", mode: "no-cors",
                                                         headers: {"content-type": "text/plain"},
                                                         body: '{"name": "csrf"}'});
  if (token) await probe("invite_with_token", node + "/api/invite", {method: "POST",
      headers: {"content-type": "application/json", "authorization": "Bearer " + token}, body: '{"ttl_s": 60}'});
  document.body.setAttribute("data-out", JSON.stringify(out));
})();
</script></body></html>"""


@pytest.fixture
def page_server() -> Iterator[tuple[int, dict[str, bytes]]]:
    """A tiny web server on 127.0.0.1 serving pages from a dict (path -> HTML)."""
    pages: dict[str, bytes] = {}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = pages.get(self.path, b"")
            self.send_response(200 if body else 404)
            self.send_header("content-type", "text/html")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1], pages
    finally:
        server.shutdown()


def browse(url: str) -> dict[str, str]:
    """Load ``url`` in headless Chromium (``evil.test`` resolves to 127.0.0.1) and return the page's results."""
    import json

    done = subprocess.run([CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
                           "--host-resolver-rules=MAP evil.test 127.0.0.1", "--virtual-time-budget=15000",
                           "--dump-dom", url], capture_output=True, text=True, timeout=60)
    marker = 'data-out="'
    start = done.stdout.find(marker)
    assert start >= 0, f"the page did not finish: {done.stdout[-500:]} {done.stderr[-500:]}"
    raw = done.stdout[start + len(marker):].split('"', 1)[0]
    return json.loads(raw.replace("&quot;", '"').replace("&amp;", "&"))


@pytest.mark.skipif(CHROMIUM is None, reason="needs chromium")
def test_a_web_page_cannot_use_the_node_without_its_token(owner: NodeProcess,
                                                          page_server: tuple[int, dict[str, bytes]]) -> None:
    port, pages = page_server
    pages["/page.html"] = (PAGE % {"node": owner.api, "token": ""}).encode()
    pages["/owner.html"] = (PAGE % {"node": owner.api, "token": owner.admin_token}).encode()
    # A page of a foreign site: CORS lets it read nothing, a preflighted call never leaves the browser,
    # and the "simple" no-cors POST a CSRF relies on is refused by the node (its Origin is foreign).
    foreign = browse(f"http://evil.test:{port}/page.html")
    assert foreign == {"status": "blocked", "invite_json": "blocked", "publish_no_cors": "opaque"}
    # A page served from this machine may read the API, but management still needs the token...
    local = browse(f"http://127.0.0.1:{port}/page.html")
    assert local == {"status": "200", "invite_json": "401", "publish_no_cors": "opaque"}
    # ...which a page that was handed it (the console, opened by `meshllm console`) sends as a Bearer.
    assert browse(f"http://localhost:{port}/owner.html")["invite_with_token"] == "200"
    published = call(owner, "GET", "/api/publish", authorization=f"Bearer {owner.admin_token}").json()
    assert not published["published"], "no page published the mesh"
