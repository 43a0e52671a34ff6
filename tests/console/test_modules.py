"""The console's JavaScript modules, run in a real Chromium against their real HTTP routes.

The pure parts of the page (the SSE parser, the RTT colour scale, the map layout, model grouping,
the chat request body, the owner gate, the optional transfers/demand cards) are imported with
``import()`` from the files the node serves, so what is tested is what ships.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest
from api.api_server import serve
from console_browser import browser_session
from fastapi import FastAPI
from fastapi.responses import HTMLResponse

from meshllm.api.console import console_router

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def page() -> Iterator[Any]:
    """A browser on an empty page of an origin that serves the console's files (no node behind it)."""
    app = FastAPI()
    app.include_router(console_router())
    app.get("/blank")(lambda: HTMLResponse("<!doctype html><title>console modules</title>"))
    with serve(app) as base, browser_session() as driver:
        driver.get(base + "/blank")
        yield driver


def run(driver: Any, body: str) -> Any:
    """Run ``body`` (an async function body that may ``await import(...)``) in the page; its return value."""
    script = (f"const done = arguments[arguments.length - 1];"
              f" (async () => {{ {body} }})().then(done, e => done('ERROR ' + e.stack));")
    result = driver.execute_async_script(script)
    assert not (isinstance(result, str) and result.startswith("ERROR")), result
    return result


def test_sse_parser_splits_events_across_chunks_and_skips_comments(page: Any) -> None:
    events = run(page, """
        const { SseParser } = await import('/console/api.js');
        const p = new SseParser();
        const out = [];
        for (const chunk of ['event: peer_joined\\ndata: {"a"', ':1}\\n', '\\n: keepalive\\n\\n', 'data: x\\r',
                             '\\ndata: y\\r\\n\\r\\n', 'data: [DONE]\\n\\n', 'data: tail-without-blank-line\\n'])
          out.push(...p.push(chunk));
        return out;
    """)
    assert events == [{"event": "peer_joined", "data": '{"a":1}'}, {"event": "", "data": "x\ny"},
                      {"event": "", "data": "[DONE]"}]


def test_rtt_scale_is_monotonic_and_clamped(page: Any) -> None:
    levels = run(page, """
        const { rttLevel } = await import('/console/matrix.js');
        return [0, 0.5, 1, 2, 10, 50, 199, 200, 5000].map(rttLevel);
    """)
    assert levels[:3] == [0, 0, 0] and levels[-2:] == [1, 1]
    assert all(a <= b for a, b in itertools.pairwise(levels)) and 0 < levels[3] < levels[5] < 1


def test_map_layout_keeps_every_node_inside_the_box(page: Any) -> None:
    bad = run(page, """
        const { layout } = await import('/console/map.js');
        const bad = [];
        for (const w of [280, 390, 560, 800, 1400]) for (let n = 1; n <= 24; n++) {
          const h = w < 560 ? w * 1.05 : 520;
          const spots = layout(n, w, h);
          if (spots.length !== n) bad.push(`${n}@${w}: ${spots.length} spots`);
          for (const s of spots)
            if (!(s.x > 20 && s.x < w - 20 && s.y > 20 && s.y < h - 20)) bad.push(`${n}@${w}: ${s.x},${s.y}`);
        }
        return bad;
    """)
    assert bad == []


def test_model_groups_tell_whole_servers_from_split_stages(page: Any) -> None:
    groups = run(page, """
        const { modelGroups } = await import('/console/models.js');
        const a = { id: 'a', name: 'a', self: true,
                    models: [{ name: 'big', engine: 'split', layers: [0, 3], context: 512 }] };
        const b = { id: 'b', name: 'b', models: [{ name: 'big', engine: 'stage', layers: [3, 6], context: 512 },
                                                { name: 'tiny', engine: 'llama', layers: null, context: 2048 }] };
        return modelGroups([a, b], [{ id: 'tiny', context_length: 2048 }]).map(g => ({
          name: g.name, context: g.context, servers: g.servers.map(s => [s.node.id, s.engine, s.layers]),
          stages: g.stages.map(s => [s.node.id, s.layers]) }));
    """)
    assert groups == [
        {"name": "big", "context": 512, "servers": [["a", "split", [0, 3]]], "stages": [["b", [3, 6]]]},
        {"name": "tiny", "context": 2048, "servers": [["b", "llama", None]], "stages": []},
    ]


def test_chat_body_sends_only_fields_the_user_set(page: Any) -> None:
    bodies = run(page, """
        const { chatBody } = await import('/console/chat.js');
        const form = document.createElement('form');
        for (const [name, value] of [['model', 'tiny'], ['system', ''], ['temperature', '0'], ['top_p', ''],
                                     ['max_tokens', '32'], ['seed', ''], ['stop', '']]) {
          const input = document.createElement('textarea');
          input.name = name; input.value = value; form.append(input);
        }
        const msgs = [{ role: 'user', content: 'hi' }];
        const first = chatBody(form, msgs);
        form.elements.namedItem('stop').value = 'END\\n\\nSTOP';
        form.elements.namedItem('seed').value = '7';
        return [first, chatBody(form, msgs)];
    """)
    base = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "stream_options": {"include_usage": True}, "temperature": 0, "max_tokens": 32}
    assert bodies == [base, {**base, "seed": 7, "stop": ["END", "STOP"]}]


def test_owner_gate_says_why_management_is_off(page: Any) -> None:
    reasons = run(page, """
        const { gateReason } = await import('/console/owner.js');
        return [gateReason(null, true), gateReason({ mesh_owner: false }, true),
                gateReason({ mesh_owner: true }, false), gateReason({ mesh_owner: true }, true)];
    """)
    assert "status" in reasons[0] and "mesh key" in reasons[1] and "token" in reasons[2] and reasons[3] == ""


def test_transfer_and_demand_cards_stay_hidden_until_the_status_has_them(page: Any) -> None:
    shown = run(page, """
        const { renderOptional, progressOf } = await import('/console/models.js');
        const card = document.createElement('article'), body = document.createElement('div');
        card.append(body); document.body.append(card);
        renderOptional(card, body, undefined);
        const absent = card.hidden;
        renderOptional(card, body, [{ model: 'big', from: 'a', to: 'b', bytes_done: 512, bytes_total: 2048 }]);
        const bar = body.querySelector('progress');
        const transfer = [card.hidden, bar && Number(bar.value), body.textContent.includes('512 B')];
        renderOptional(card, body, { tiny: { request_count: 3, last_active: 1700000000 } });
        const demand = [card.hidden, body.textContent.includes('request_count'), body.textContent.includes('tiny')];
        return { absent, transfer, demand, progress: [progressOf({ progress: 2 }), progressOf({ done: 1, total: 4 }),
                                                      progressOf({ model: 'x' })] };
    """)
    assert shown == {"absent": True, "transfer": [False, 0.25, True], "demand": [False, True, True],
                     "progress": [1, 0.25, None]}


def test_a_chain_being_placed_shows_each_stage_fetch(page: Any) -> None:
    shown = run(page, """
        const { renderSplits } = await import('/console/models.js');
        const box = document.createElement('div'); document.body.append(box);
        const stage = (name, layers, fetch) => ({ node_id: name, name, layers, fetch });
        const split = (state) => ({ model: 'tiny', state, reason: null, stages: [
            stage('c', [0, 2], { bytes_done: 2048, bytes_total: 2048, rate_bytes_s: 1024, eta_s: 0 }),
            stage('w1', [2, 4], { bytes_done: 512, bytes_total: 2048, rate_bytes_s: 256, eta_s: 6 }),
            stage('w2', [4, 6], null)] });
        renderSplits(box, { splits: [split('placing')] }, []);
        const bars = [...box.querySelectorAll('progress')].map((b) => Number(b.value));
        const text = box.textContent;
        renderSplits(box, { splits: [split('ready')] }, []);
        return { bars, left: text.includes('6s left'), of: text.includes('512 B of 2.0 KiB · 256 B/s'),
                 ready: box.querySelectorAll('progress').length };
    """)
    assert shown == {"bars": [1, 0.25], "left": True, "of": True, "ready": 0}, shown


def test_unknown_event_types_are_summarised_from_their_fields(page: Any) -> None:
    texts = run(page, """
        const { summarise } = await import('/console/live.js');
        const names = new Map([['n1', 'alpha']]);
        return [summarise({ type: 'peer_joined', ts: 1, node_id: 'n1' }, names),
                summarise({ type: 'peer_left', ts: 1, node_id: 'zzzzzzzzzzzz', reason: 'down' }, names),
                summarise({ type: 'peer_left', ts: 1, node_id: 'n2', reason: 'down', accuser: 'n1' }, names),
                summarise({ type: 'peer_joined', ts: 1, node_id: 'n2', name: 'beta' }, names),
                summarise({ type: 'something_new', ts: 1, model: 'm', n: 3 }, names)];
    """)
    assert texts == ["alpha joined", "zzzzzzzz left (down)", "n2 left (down, said alpha)", "beta joined", "model=m n=3"]


def test_the_event_list_prepends_new_events_instead_of_redrawing(page: Any) -> None:
    # Its live region must announce only new events: existing items stay the same DOM nodes.
    result = run(page, """
        const { EventLog } = await import('/console/live.js');
        const list = document.createElement('ol'), toggle = document.createElement('input');
        toggle.type = 'checkbox'; document.body.append(list, toggle);
        const log = new EventLog(list, toggle), names = new Map([['n1', 'alpha']]);
        log.add({ type: 'peer_joined', ts: 1, node_id: 'n1' });
        log.add({ type: 'record_updated', ts: 2, node_id: 'n1', seq: 5 });
        log.render(names);
        const first = list.firstElementChild;
        const again = log.add({ type: 'peer_joined', ts: 1, node_id: 'n1' });  // a reconnect's replay
        log.add({ type: 'peer_left', ts: 3, node_id: 'n1', reason: 'down' });
        log.render(names);
        const kept = list.children[1] === first;
        toggle.checked = true; toggle.dispatchEvent(new Event('change'));
        return { again, kept, texts: [...list.children].map(li => li.querySelector('.ev-text').textContent) };
    """)
    assert result == {"again": False, "kept": True,
                      "texts": ["alpha left (down)", "alpha record #5", "alpha joined"]}


def test_owner_control_gate_and_answers(page: Any) -> None:
    out = run(page, """
        const { controlGate, describeAnswer, renderStandby } = await import('/console/control.js');
        const me = { node_id: 'self', owner_key: null };
        const gates = [controlGate(null, true, 'x'), controlGate(me, false, 'self'), controlGate(me, true, 'self'),
                       controlGate(me, true, 'other'), controlGate({ ...me, owner_key: 'k' }, true, 'other')];
        const answers = [
          describeAnswer('load', { model: 'm', context: 2048, loaded: true }),
          describeAnswer('unload', { model: 'm', drained: false, cancelled: 2, waited_s: 60 }),
          describeAnswer('drain', { ok: false, code: 'uncertified', message: 'no certificate' }),
          describeAnswer('status', { ok: true, code: 'ok', message: 'status' })];
        const card = document.createElement('article'), body = document.createElement('div');
        card.append(body); document.body.append(card);
        renderStandby(card, body, null);
        const hidden = card.hidden;
        renderStandby(card, body, { enabled: true, candidates: ['tiny'], serving: ['tiny'], idle_s: 300,
          waiting: [{ model: 'qwen', reason: 'queue', for_s: 1.5 }],
          decisions: [{ at: 1700000000, model: 'tiny', action: 'promote', reason: 'queue' }] });
        return { gates, answers, hidden, shown: !card.hidden, text: body.textContent,
                 decision: body.querySelector('li')?.dataset.action };
    """)
    gates = out["gates"]
    assert "status" in gates[0] and "token" in gates[1] and gates[2] == "" and "owner keystore" in gates[3]
    assert gates[4] == ""
    assert out["answers"] == ["loaded m (context 2048)",
                              "unloaded m; 2 requests still running were cancelled",
                              "refused (uncertified): no certificate", "status"]
    assert out["hidden"] and out["shown"] and out["decision"] == "promote"
    text = out["text"]
    assert "library tiny" in text and "qwen: queue for 1.5 s" in text and "promote tiny (queue)" in text


def test_blackboard_search_query_and_note_age(page: Any) -> None:
    out = run(page, """
        const { boardQuery, age } = await import('/console/blackboard.js');
        return [boardQuery('', '', ''), boardQuery(' QUESTION: gpu ', 'alpha', '6', 20),
                age(1000, 1000 * 1000 + 59000), age(1000, 1000 * 1000 + 7200 * 1000)];
    """)
    assert out == ["/api/blackboard?limit=50", "/api/blackboard?limit=20&q=QUESTION%3A+gpu&from=alpha&since_s=21600",
                   "59s ago", "2h ago"]
