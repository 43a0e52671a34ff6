"""Owner commands across real nodes (subprocesses through the CLI, real QUIC and llama.cpp on 127.0.0.1).

The mesh: ``alpha`` is the owner's node (the owner keystore is in its home) serving ``tiny``; ``beta``
is certified by the owner and trusts it; ``gamma`` is an uncertified ``--client``; ``delta`` is
certified but accepts only ``beta`` as a peer (trust policy allowlist), so alpha reaches it only
through beta. Commands are sealed by ``meshllm owner`` (or, for the attacks, by this test with the
same modules) and carried by alpha's ``/api/owner/relay``.
"""

from __future__ import annotations

import base64
import json
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from nacl.signing import SigningKey
from nodes import NodeProcess, meshllm, meshllm_json, running_nodes, wait_until
from tinymodels import write_tiny_llama

from meshllm.identity.keys import NodeKey
from meshllm.identity.keystore import unlock_keystore
from meshllm.owner.commands import OwnerCommand, OwnerResult, open_result, seal_command

pytestmark = pytest.mark.timeout(240)

PASSPHRASE = "owner passphrase for tests"


@dataclass
class Mesh:
    alpha: NodeProcess
    beta: NodeProcess
    gamma: NodeProcess
    delta: NodeProcess
    models: Path
    owner_key: SigningKey

    @property
    def nodes(self) -> list[NodeProcess]:
        return [self.alpha, self.beta, self.gamma, self.delta]


def listed(node: NodeProcess, model: str) -> list[str]:
    data = httpx.get(f"{node.api}/v1/models", timeout=5).json()["data"]
    return next((m["nodes"] for m in data if m["id"] == model), [])


def ok(done: object) -> None:
    assert done.returncode == 0, f"exit {done.returncode}: {done.stdout} {done.stderr}"  # type: ignore[attr-defined]


def certify(owner_home: Path, home: Path, owner_pub: str, *, allow: str | None = None) -> None:
    """Trust the owner in ``home`` and install a certificate the owner signs for that node."""
    ok(meshllm("auth", "trust", "add", owner_pub, "--home", str(home)))
    node_id = NodeKey.load_or_create(home).node_id
    token = meshllm_json("auth", "sign-node", "--home", str(owner_home), "--node-id", node_id)["token"]
    ok(meshllm("auth", "install-cert", token, "--home", str(home)))
    if allow is not None:
        ok(meshllm("auth", "trust", "allow", allow, "--home", str(home)))
        ok(meshllm("auth", "trust", "policy", "allowlist", "--home", str(home)))


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    tmp = tmp_path_factory.mktemp("owner")
    models = tmp / "models"
    models.mkdir()
    for name, seed in (("tiny", 0), ("tiny2", 1)):
        write_tiny_llama(models / f"{name}.gguf", seed=seed)
    # slower (width 256, 6 layers): a long stream on it outlasts the CLI's start-up
    write_tiny_llama(models / "tiny3.gguf", seed=3, n_layers=6, width=256, heads=8, ffn=1024)
    saved = os.environ.get("MESHLLM_OWNER_PASSPHRASE")
    os.environ["MESHLLM_OWNER_PASSPHRASE"] = PASSPHRASE
    try:
        homes = {n: tmp / n for n in ("alpha", "beta", "gamma", "delta")}
        ok(meshllm("auth", "init", "--home", str(homes["alpha"])))
        owner_pub = meshllm_json("auth", "status", "--home", str(homes["alpha"]))["owner_pub"]
        beta_id = NodeKey.load_or_create(homes["beta"]).node_id
        certify(homes["alpha"], homes["beta"], owner_pub)
        certify(homes["alpha"], homes["delta"], owner_pub, allow=beta_id)
        with running_nodes() as nodes:
            alpha = NodeProcess(homes["alpha"], ["--model", str(models / "tiny.gguf")], "alpha")
            nodes.append(alpha)
            token = alpha.wait_ready()["invite"]
            beta = NodeProcess(homes["beta"], ["--model", str(models / "tiny.gguf"), "--join", token], "beta")
            gamma = NodeProcess(homes["gamma"], ["--client", "--member", "--join", token], "gamma")
            nodes += [beta, gamma]
            beta.wait_ready()
            gamma.wait_ready()
            delta = NodeProcess(homes["delta"],
                                ["--client", "--member", "--join", token, "--bootstrap", beta.mesh_addr], "delta")
            nodes.append(delta)
            delta.wait_ready()
            wait_until(lambda: len(alpha.status()["peers"]) == 3 and len(listed(gamma, "tiny")) == 2, 20.0)
            key = unlock_keystore(homes["alpha"] / "owner.keystore", PASSPHRASE)
            yield Mesh(alpha, beta, gamma, delta, models, key)
    finally:
        if saved is None:
            os.environ.pop("MESHLLM_OWNER_PASSPHRASE", None)
        else:
            os.environ["MESHLLM_OWNER_PASSPHRASE"] = saved


def owner(mesh: Mesh, node: str, *args: str, timeout: float = 60.0) -> dict[str, object]:
    """``meshllm owner NODE ...`` through alpha, as the owner would type it; its JSON answer."""
    done = meshllm("owner", node, *args, *mesh.alpha.api_args, "--json", timeout=timeout)
    answer = json.loads(done.stdout)
    assert (done.returncode == 0) == answer["ok"], done.stderr
    return answer


def test_the_owner_loads_a_model_on_a_remote_node_and_every_node_lists_it(mesh: Mesh) -> None:
    answer = owner(mesh, "beta", "load", str(mesh.models / "tiny2.gguf"))
    returned = time.monotonic()
    assert answer["ok"] and answer["code"] == "ok" and answer["data"]["model"] == "tiny2"  # type: ignore[index]
    took = wait_until(lambda: all(listed(n, "tiny2") == [mesh.beta.node_id] for n in mesh.nodes), 2.0)
    print(f"tiny2 listed by all {len(mesh.nodes)} nodes {took + time.monotonic() - returned - took:.2f} s "
          f"after `meshllm owner beta load` returned")
    reply = openai.OpenAI(base_url=f"{mesh.gamma.api}/v1", api_key="x", max_retries=0).completions.create(
        model="tiny2", prompt="Once", max_tokens=8, temperature=0)
    assert reply.usage is not None and reply.usage.completion_tokens == 8
    done = mesh.beta.wait_event(lambda e: e["type"] == "owner_done" and e["model"].endswith("tiny2.gguf"), 5)
    assert done["ok"] is True
    again = owner(mesh, "beta", "load", str(mesh.models / "tiny2.gguf"))
    assert again["ok"] and again["data"]["loaded"] is False  # type: ignore[index]


def test_unload_drains_a_running_stream_first(mesh: Mesh) -> None:
    owner(mesh, "beta", "load", str(mesh.models / "tiny3.gguf"))
    wait_until(lambda: listed(mesh.gamma, "tiny3") == [mesh.beta.node_id], 5.0)
    client = openai.OpenAI(base_url=f"{mesh.gamma.api}/v1", api_key="x", max_retries=0, timeout=60)
    stream = client.completions.create(model="tiny3", prompt="a", max_tokens=1900, temperature=0, stream=True,
                                       stream_options={"include_usage": True})  # several seconds of tokens
    chunks = [next(iter(stream))]
    unloaded: dict[str, object] = {}
    worker = threading.Thread(target=lambda: unloaded.update(owner(mesh, "beta", "unload", "tiny3")))
    worker.start()
    wait_until(lambda: not listed(mesh.gamma, "tiny3"), 5.0)  # out of routing while the stream still runs
    chunks += list(stream)
    worker.join(60)
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 1900, "the stream was cut short"
    draining = mesh.beta.wait_event(lambda e: e["type"] == "model_draining" and e["model"] == "tiny3", 5.0)
    assert draining["in_flight"] == 1  # the unload began while the stream ran, and waited for it
    assert unloaded["ok"] and unloaded["data"]["drained"] is True and unloaded["data"]["cancelled"] == 0  # type: ignore[index]
    print(f"unload waited {unloaded['data']['waited_s']} s for the stream to finish")  # type: ignore[index]
    assert all(not listed(n, "tiny3") for n in mesh.nodes)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="tiny3", prompt="a", max_tokens=4)


def test_commands_reach_a_node_the_owner_is_not_connected_to(mesh: Mesh) -> None:
    peers = {p["name"]: p for p in mesh.alpha.status()["peers"]}
    assert peers["delta"]["path"] == "none"  # delta refuses alpha: only beta may connect to it
    answer = owner(mesh, "delta", "status")
    assert answer["ok"] and answer["data"]["node_id"] == mesh.delta.node_id  # type: ignore[index]
    assert any(e["type"] == "owner_relayed" and e["target"] == mesh.delta.node_id for e in mesh.beta.events)
    renamed = owner(mesh, "delta", "config", "name=delta-renamed")
    assert renamed["ok"]
    wait_until(lambda: any(p["name"] == "delta-renamed" for p in mesh.alpha.status()["peers"]), 5.0)
    owner(mesh, mesh.delta.node_id[:10], "config", "name=delta")


def test_drain_unloads_everything_and_status_and_config_report(mesh: Mesh) -> None:
    owner(mesh, "beta", "load", str(mesh.models / "tiny3.gguf"))
    status = owner(mesh, "beta", "status")["data"]
    assert {m["model"] for m in status["models"]} >= {"tiny", "tiny3"}  # type: ignore[index]
    refused = owner(mesh, "beta", "config", "standby=on")
    assert not refused["ok"] and "standby" in str(refused["message"])
    drained = owner(mesh, "beta", "drain")
    assert drained["ok"] and {r["model"] for r in drained["data"]["unloaded"]} >= {"tiny", "tiny3"}  # type: ignore[index]
    wait_until(lambda: listed(mesh.gamma, "tiny") == [mesh.alpha.node_id], 5.0)
    assert owner(mesh, "beta", "status")["data"]["models"] == []  # type: ignore[index]
    owner(mesh, "beta", "load", str(mesh.models / "tiny.gguf"))
    wait_until(lambda: len(listed(mesh.gamma, "tiny")) == 2, 5.0)


def test_models_load_and_unload_on_the_node_itself(mesh: Mesh) -> None:
    done = meshllm("models", "load", str(mesh.models / "tiny3.gguf"), *mesh.alpha.api_args)
    ok(done)
    assert "loaded tiny3" in done.stdout
    wait_until(lambda: listed(mesh.gamma, "tiny3") == [mesh.alpha.node_id], 2.0)
    answer = meshllm_json("models", "unload", "tiny3", *mesh.alpha.api_args)
    assert answer == {"model": "tiny3", "drained": True, "cancelled": 0, "waited_s": answer["waited_s"]}
    # two loads of one model at once: one loads it, the other waits for that load
    answers: list[dict[str, object]] = []

    def load() -> None:
        answers.append(httpx.post(f"{mesh.alpha.api}/api/models/load", json={"model": str(mesh.models / "tiny3.gguf")},
                                  headers=mesh.alpha.admin_headers, timeout=60).json())

    loaders = [threading.Thread(target=load) for _ in range(2)]
    for t in loaders:
        t.start()
    for t in loaders:
        t.join(60)
    assert sorted(bool(a["loaded"]) for a in answers) == [False, True], answers
    loads = [e for e in mesh.alpha.events if e["type"] == "model_loading" and e["model"] == "tiny3"]
    assert len(loads) == 2  # the load above, and one for both of these
    meshllm_json("models", "unload", "tiny3", *mesh.alpha.api_args)
    missing = meshllm("models", "unload", "tiny3", *mesh.alpha.api_args)
    assert missing.returncode == 1 and "does not serve 'tiny3'" in missing.stderr
    unauthorised = httpx.post(f"{mesh.alpha.api}/api/models/load", json={"model": "default"}, timeout=5)
    assert unauthorised.status_code == 401
    extra = httpx.post(f"{mesh.alpha.api}/api/models/load", json={"model": "x", "engine": "ggml"},
                       headers=mesh.alpha.admin_headers, timeout=5)
    assert extra.status_code == 400 and extra.json()["error"]["param"] == "engine"  # a field the route does not know


# ---- refusals: each changes nothing and is logged by the node it was meant for ------------------------


def relay(mesh: Mesh, envelope: bytes) -> bytes:
    answer = httpx.post(f"{mesh.alpha.api}/api/owner/relay", headers=mesh.alpha.admin_headers, timeout=30,
                        json={"envelope": base64.b64encode(envelope).decode()})
    assert answer.status_code == 200, answer.text
    return base64.b64decode(answer.json()["result"])


def refused(mesh: Mesh, node: NodeProcess, envelope: bytes, code: str) -> OwnerResult:
    """Send ``envelope`` through alpha; check ``node`` answered with refusal ``code``, logged it, loaded nothing."""
    before = {m["name"] for m in node.status()["models"]}
    result = open_result(mesh.owner_key, relay(mesh, envelope), envelope, node.node_id, time.time())
    assert (result.ok, result.code) == (False, code), result
    node.wait_event(lambda e: e["type"] == "owner_refused" and e["code"] == code, 5.0)
    time.sleep(0.5)
    assert {m["name"] for m in node.status()["models"]} == before
    return result


def load_tiny2(key: SigningKey, node: NodeProcess, now: float | None = None) -> bytes:
    command = OwnerCommand(op="load", model=str(Path(node.home).parent / "models" / "tiny2.gguf"))
    return seal_command(key, node.node_id, command, time.time() if now is None else now)


def test_a_replayed_command_is_refused(mesh: Mesh) -> None:
    envelope = load_tiny2(mesh.owner_key, mesh.beta)
    owner(mesh, "beta", "unload", "tiny2")
    first = open_result(mesh.owner_key, relay(mesh, envelope), envelope, mesh.beta.node_id, time.time())
    assert first.ok
    owner(mesh, "beta", "unload", "tiny2")
    refused(mesh, mesh.beta, envelope, "replayed")  # it would have loaded tiny2 again


def test_an_expired_command_is_refused(mesh: Mesh) -> None:
    refused(mesh, mesh.beta, load_tiny2(mesh.owner_key, mesh.beta, now=time.time() - 120), "expired")


def test_a_tampered_command_is_refused(mesh: Mesh) -> None:
    data = bytearray(load_tiny2(mesh.owner_key, mesh.beta))
    data[-80] ^= 0x01  # inside the encrypted payload
    refused(mesh, mesh.beta, bytes(data), "tampered")


def test_a_command_from_another_owner_is_refused(mesh: Mesh) -> None:
    refused(mesh, mesh.beta, load_tiny2(SigningKey.generate(), mesh.beta), "wrong_owner")


def test_a_command_to_an_uncertified_node_is_refused(mesh: Mesh) -> None:
    refused(mesh, mesh.gamma, load_tiny2(mesh.owner_key, mesh.gamma), "uncertified")
    done = meshllm("owner", "gamma", "status", *mesh.alpha.api_args)
    assert done.returncode == 1 and "uncertified" in done.stderr
