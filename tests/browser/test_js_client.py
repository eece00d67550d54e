"""clients/js/wsserver.js in headless Chromium against a live wsserver.

The module is imported into a page of the server's own origin (``/healthz``,
so the chat page's own client is not in the way) and exercised with
``page.evaluate``: the assertions are about what the module hands its caller.
Where a race has to be forced (a delta already on the wire when the caller
cancels), Playwright's WebSocket routing sits between page and server and
injects the frame.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from .conftest import LiveServer, reference_text

pytestmark = pytest.mark.browser


def module_page(page: Any, server: LiveServer) -> None:
    """Load a page of the server's origin and import the module as ``window.ws``."""
    page.goto(server.http_url + "healthz")
    page.evaluate("async () => { window.ws = await import('/wsserver.js'); }")


def test_generate_streams_text_and_done(page: Any, live_server: LiveServer) -> None:
    module_page(page, live_server)
    result = page.evaluate(
        """async (url) => {
            const { WsClient } = window.ws;
            const client = new WsClient(url);
            const states = [];
            client.on('state', (e) => states.push(e.state));
            // Made while still connecting: sent once the hello arrives.
            const stream = client.generate({ prompt: 'hello', max_tokens: 50, seed: 3, top_p: null });
            const events = [];
            stream.on('started', () => events.push('started'));
            let text = '';
            let pieces = 0;
            for await (const piece of stream) { text += piece; pieces++; }
            const done = await stream.done;
            const hello = client.hello;
            client.close();
            return { text, pieces, done, events, states, status: stream.status,
                     streamText: stream.text, hello, finalState: client.state };
        }""",
        live_server.ws_url,
    )
    expected, reference = reference_text(live_server, prompt="hello", max_tokens=50, seed=3)
    assert result["text"] == result["streamText"] == expected
    assert result["pieces"] >= 2
    assert result["done"]["reason"] == reference["reason"] == "length"
    assert result["done"]["usage"]["completion_tokens"] == 50
    assert result["events"] == ["started"]
    assert result["status"] == "done"
    assert result["hello"]["model"] == "fake" and result["hello"]["protocol"] == 1
    assert result["states"] == ["open", "closed"]  # 'connecting' was emitted in the constructor
    assert result["finalState"] == "closed"


def test_late_frames_after_cancel_or_restart_never_reach_the_caller(
    page: Any, live_server: LiveServer
) -> None:
    """A delta already on the wire when the caller cancels (or restarts) is
    dropped by the module. The test forces that race: the route below injects
    such a delta, with a valid next seq, just before the cancel reaches the server."""
    injected: list[str] = []

    def route(ws: Any) -> None:
        server = ws.connect_to_server()
        last_seq: dict[str, int] = {}

        def from_server(message: str | bytes) -> None:
            frame = json.loads(message)
            if frame.get("type") == "delta":
                last_seq[frame["id"]] = frame["seq"]
            ws.send(message)

        def from_page(message: str | bytes) -> None:
            frame = json.loads(message)
            if frame["type"] in ("cancel", "restart") and frame["id"] in last_seq:
                late = {
                    "type": "delta",
                    "id": frame["id"],
                    "seq": last_seq[frame["id"]] + 1,
                    "text": "<LATE>",
                }
                ws.send(json.dumps(late))
                injected.append(frame["id"])
            server.send(message)

        server.on_message(from_server)
        ws.on_message(from_page)

    page.route_web_socket(re.compile(r"^ws://"), route)
    module_page(page, live_server)
    result = page.evaluate(
        """async (url) => {
            const { WsClient } = window.ws;
            const client = new WsClient(url);
            const wire = [];
            client.on('frame', (f) => { if (f.type === 'delta') wire.push([f.id, f.text]); });
            const firstText = (stream) => new Promise((resolve) => stream.on('delta', resolve));

            // Cancel: the iteration ends at once, the done follows, no late text.
            const a = client.generate({ prompt: 'cancel me', max_tokens: 5000 });
            let aText = '';
            const aLoop = (async () => { for await (const t of a) aText += t; })();
            await firstText(a);
            const cancelling = a.cancel();
            const aStreamTextAtCancel = a.text;
            const aDone = await cancelling;
            await aLoop;

            // Restart: the old stream yields nothing more; the new one only its own text.
            const b = client.generate({ prompt: 'restart me', max_tokens: 5000 });
            let bText = '';
            const bLoop = (async () => { for await (const t of b) bText += t; })();
            await firstText(b);
            const c = client.restart(b, { seed: 5, max_tokens: 20 });
            const bStreamTextAtRestart = b.text;
            let cText = '';
            for await (const t of c) cText += t;
            await bLoop;
            const bDone = await b.done;
            const cDone = await c.done;
            client.close();
            return {
                aText, aStreamText: a.text, aStreamTextAtCancel, aDone, aId: a.id,
                bText, bStreamTextAtRestart, bStreamText: b.text, bDone, bId: b.id,
                cText, cDone, cStatus: c.status,
                lateOnWire: wire.filter(([, text]) => text === '<LATE>').map(([id]) => id),
            };
        }""",
        live_server.ws_url,
    )
    # The race really happened: the late frames reached the module ...
    assert sorted(injected) == sorted([result["aId"], result["bId"]])
    assert sorted(result["lateOnWire"]) == sorted(injected)
    # ... and went no further.
    for key in ("aText", "aStreamText", "bText", "bStreamText", "cText"):
        assert "<LATE>" not in result[key], key
    assert result["aDone"]["reason"] == "cancelled"
    assert result["bDone"]["reason"] == "cancelled"
    # Not a character more after the cancel or restart: the stream's text is
    # what had arrived before, and the loop got (a prefix of) that — a piece
    # still buffered for the loop when the caller gave up is not handed out.
    assert result["aStreamText"] == result["aStreamTextAtCancel"]
    assert result["aStreamText"].startswith(result["aText"])
    assert result["bStreamText"] == result["bStreamTextAtRestart"]
    assert result["bStreamText"].startswith(result["bText"])
    expected, _ = reference_text(live_server, prompt="restart me", max_tokens=20, seed=5)
    assert result["cText"] == expected
    assert result["cDone"]["reason"] == "length" and result["cStatus"] == "done"


def test_leaving_the_loop_or_aborting_cancels(page: Any, live_server: LiveServer) -> None:
    module_page(page, live_server)
    result = page.evaluate(
        """async (url) => {
            const { WsClient } = window.ws;
            const client = new WsClient(url);
            const a = client.generate({ prompt: 'break', max_tokens: 5000 });
            for await (const _ of a) break;
            const aDone = await a.done;

            const controller = new AbortController();
            const b = client.generate({ prompt: 'abort', max_tokens: 5000 }, { signal: controller.signal });
            await new Promise((resolve) => b.on('delta', resolve));
            controller.abort();
            const bDone = await b.done;

            // Cancelled before it was ever sent: the server never hears of it.
            const offline = new WsClient(url, { connect: false });
            const c = offline.generate({ prompt: 'never sent' });
            const cDone = await c.cancel();
            offline.close();
            client.close();
            return { aDone, aAbandoned: a.abandoned, bDone, cDone, cStatus: c.status };
        }""",
        live_server.ws_url,
    )
    assert result["aDone"]["reason"] == "cancelled" and result["aAbandoned"]
    assert result["bDone"]["reason"] == "cancelled"
    assert result["cDone"]["reason"] == "cancelled" and result["cDone"]["local"] is True
    assert result["cStatus"] == "done"


def test_error_frames_fail_only_their_request(page: Any, live_server: LiveServer) -> None:
    module_page(page, live_server)
    result = page.evaluate(
        """async (url) => {
            const { WsClient, WsError } = window.ws;
            const client = new WsClient(url);
            const failure = async (stream) => {
                try {
                    for await (const _ of stream) {}
                    return null;
                } catch (error) {
                    let rejected = null;
                    await stream.done.catch((e) => { rejected = e.code; });
                    return { code: error.code, isWsError: error instanceof WsError,
                             requestId: error.requestId, rejected, status: stream.status };
                }
            };
            const running = client.generate({ prompt: 'keep going', max_tokens: 60 });
            const busy = client.generate({ prompt: 'one at a time' });
            const busyFailure = await failure(busy);
            const runningResult = await running.result();

            const first = client.generate({ prompt: 'x', max_tokens: 2 }, { id: 'same-id' });
            await first.result();
            const again = client.generate({ prompt: 'x', max_tokens: 2 }, { id: 'same-id' });
            const duplicate = await failure(again);

            const unknown = client.restart('never-seen', { max_tokens: 2 });
            const unknownFailure = await failure(unknown);

            const clientErrors = [];
            client.on('error', (e) => clientErrors.push(e.code));
            const after = await client.generate({ prompt: 'still usable', max_tokens: 3 }).result();
            client.close();
            return { busyFailure, busyId: busy.id, running: runningResult.done.reason,
                     duplicate, unknownFailure, after: after.done.reason, clientErrors };
        }""",
        live_server.ws_url,
    )
    assert result["busyFailure"] == {
        "code": "busy",
        "isWsError": True,
        "requestId": result["busyId"],
        "rejected": "busy",
        "status": "failed",
    }
    assert result["running"] == "length"
    assert result["duplicate"]["code"] == "duplicate_id"
    assert result["unknownFailure"]["code"] == "unknown_id"
    assert result["after"] == "length"
    assert result["clientErrors"] == []


def test_a_dropped_connection_fails_the_request_in_flight_and_never_replays_it(
    page: Any, live_server: LiveServer
) -> None:
    module_page(page, live_server)
    page.evaluate(
        """async (url) => {
            const { WsClient } = window.ws;
            const sent = window.__sent = [];
            class LoggingWebSocket extends WebSocket {
                send(data) { sent.push(JSON.parse(data)); super.send(data); }
            }
            const client = window.__client = new WsClient(url, {
                WebSocket: LoggingWebSocket, reconnect: { initialDelayMs: 50, jitter: 0 },
            });
            window.__states = [];
            client.on('state', (e) => window.__states.push(e.state));
            const stream = window.__stream = client.generate({ prompt: 'in flight', max_tokens: 5000 });
            window.__outcome = (async () => {
                let text = '';
                try {
                    for await (const t of stream) text += t;
                    return { error: null };
                } catch (error) {
                    let rejected = null;
                    await stream.done.catch((e) => { rejected = e.code; });
                    return { error: error.code, rejected, status: stream.status, text };
                }
            })();
            await new Promise((resolve) => stream.on('delta', resolve));
        }""",
        live_server.ws_url,
    )
    assert live_server.drop_connections() == 1
    outcome = page.evaluate("() => window.__outcome")
    assert outcome["error"] == "connection_lost"
    assert outcome["rejected"] == "connection_lost"
    assert outcome["status"] == "failed"
    assert outcome["text"]

    after = page.evaluate(
        """async () => {
            const client = window.__client;
            await client.ready();
            const next = await client.generate({ prompt: 'after the drop', max_tokens: 5 }).result();
            client.close();
            return {
                next: next.done.reason,
                states: window.__states,
                generates: window.__sent.filter((f) => f.type === 'generate').map((f) => f.id),
                id: window.__stream.id,
            };
        }"""
    )
    assert after["next"] == "length"
    assert after["states"][:4] == ["open", "reconnecting", "connecting", "open"]
    # Sent exactly once: never replayed on the new connection.
    assert after["generates"].count(after["id"]) == 1
    assert len(after["generates"]) == 2


def test_reconnects_with_exponential_backoff(page: Any, live_server: LiveServer) -> None:
    module_page(page, live_server)
    page.evaluate(
        """async (url) => {
            const { WsClient } = window.ws;
            const client = window.__client = new WsClient(url, {
                reconnect: { initialDelayMs: 40, factor: 2, maxDelayMs: 320, jitter: 0 },
            });
            const log = window.__log = [];
            client.on('state', (e) => log.push({ state: e.state, delayMs: e.delayMs,
                                                 attempt: e.attempt, at: performance.now() }));
            await client.ready();
        }""",
        live_server.ws_url,
    )
    live_server.stop()
    page.wait_for_function(
        "() => window.__log.filter((e) => e.state === 'reconnecting').length >= 6"
    )
    live_server.start()
    page.evaluate("() => window.__client.ready()")
    log = page.evaluate("() => window.__log")

    retries = [e for e in log if e["state"] == "reconnecting"]
    delays = [e["delayMs"] for e in retries]
    assert delays[:6] == [40, 80, 160, 320, 320, 320]
    assert [e["attempt"] for e in retries[:6]] == [1, 2, 3, 4, 5, 6]
    # Each retry waited its delay before connecting again.
    for index, entry in enumerate(log[:-1]):
        if entry["state"] == "reconnecting":
            following = log[index + 1]
            assert following["state"] == "connecting"
            assert following["at"] - entry["at"] >= entry["delayMs"] - 2, (entry, following)
    assert log[-1]["state"] == "open"

    # A successful connection resets the backoff.
    assert live_server.drop_connections() == 1
    page.wait_for_function(
        "() => window.__client.state === 'open' && window.__log.length > " + str(len(log))
    )
    tail = page.evaluate("() => window.__log")[len(log) :]
    assert tail[0]["state"] == "reconnecting" and tail[0]["delayMs"] == 40
    result = page.evaluate(
        """async () => {
            const r = await window.__client.generate({ prompt: 'back', max_tokens: 4 }).result();
            window.__client.close();
            return r.done.reason;
        }"""
    )
    assert result == "length"


def test_token_travels_as_a_subprotocol(
    page: Any, live_server: LiveServer, live_server_factory: Any
) -> None:
    token = "t0ken-for_the.test"
    guarded = live_server_factory(**{"security.auth_token": token})
    module_page(page, live_server)  # the module comes from an open server on another port
    result = page.evaluate(
        """async ([url, token]) => {
            const { WsClient, SUBPROTOCOL } = window.ws;
            const attempt = async (options) => {
                const client = new WsClient(url, { ...options, reconnect: false });
                try {
                    await client.ready();
                    const r = await client.generate({ prompt: 'auth', max_tokens: 3 }).result();
                    return r.done.reason;
                } catch (error) {
                    return error.code;
                } finally {
                    client.close();
                }
            };
            let badToken = null;
            try { new WsClient(url, { token: 'not a token', connect: false }); }
            catch (error) { badToken = error.name; }
            return {
                withToken: await attempt({ token }),
                without: await attempt({}),
                wrong: await attempt({ token: 'wrong' }),
                badToken, SUBPROTOCOL,
            };
        }""",
        [guarded.ws_url, token],
    )
    assert result == {
        "withToken": "length",
        "without": "closed",
        "wrong": "closed",
        "badToken": "TypeError",
        "SUBPROTOCOL": "wsserver.v1",
    }
