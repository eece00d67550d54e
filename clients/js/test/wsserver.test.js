// wsserver.js under Node.js, against a real wsserver (fake backend).
//
// Run by tests/test_js_node.py, which starts the server and a small control
// endpoint and passes both in the environment:
//
//   WSSERVER_URL       ws://127.0.0.1:PORT/ of the server
//   WSSERVER_CONTROL   http://127.0.0.1:PORT2/ — POST drop (abort every
//                      connection, as a crash would), stop, start (same port),
//                      GET cancelled (the server's count of `done` frames with
//                      reason cancelled), expected?prompt=&max_tokens=&seed=
//                      (the fake model's text, computed without the server)
//   WSSERVER_TEST_UNIT scales every timeout, as in the Python suite
//
// Node 20 needs --experimental-websocket for the global WebSocket; Node 22
// and later have it by default. Nothing here waits on a timer: every wait is
// on an event of the client or the answer of the control endpoint.

import { createHash } from "node:crypto";
import { test } from "node:test";
import assert from "node:assert/strict";

import { WsClient, WsError } from "../wsserver.js";

const SERVER = process.env.WSSERVER_URL;
const CONTROL = process.env.WSSERVER_CONTROL;
if (!SERVER || !CONTROL) {
  throw new Error("run through tests/test_js_node.py (scripts/test): it starts the server");
}
const UNIT = Number(process.env.WSSERVER_TEST_UNIT ?? "1");
const TIMEOUT = 30_000 * UNIT;

/**
 * @param {string} path
 * @param {"GET" | "POST"} [method]
 * @returns {Promise<any>}
 */
async function control(path, method = "GET") {
  const response = await fetch(new URL(path, CONTROL), { method });
  const body = await response.json();
  if (!response.ok) throw new Error(`control ${path}: ${JSON.stringify(body)}`);
  return body;
}

/**
 * @param {string} prompt
 * @param {number} maxTokens
 * @param {number} [seed]
 * @returns {Promise<string>}
 */
async function expectedText(prompt, maxTokens, seed) {
  const query = new URLSearchParams({ prompt, max_tokens: String(maxTokens) });
  if (seed !== undefined) query.set("seed", String(seed));
  return (await control(`expected?${query}`)).text;
}

/** Resolves with the first piece of text the stream receives. */
function firstDelta(stream) {
  return new Promise((resolve) => {
    const off = stream.on("delta", (text) => {
      off();
      resolve(text);
    });
  });
}

/** Resolves once `predicate(log)` holds for the client's state events so far. */
function stateLog(client) {
  /** @type {Array<import("../wsserver.d.ts").StateEvent>} */
  const log = [];
  /** @type {Array<[(log: typeof log) => boolean, () => void]>} */
  const waiters = [];
  client.on("state", (event) => {
    log.push(event);
    for (const waiter of [...waiters]) {
      if (waiter[0](log)) {
        waiters.splice(waiters.indexOf(waiter), 1);
        waiter[1]();
      }
    }
  });
  const until = (predicate) =>
    predicate(log) ? Promise.resolve() : new Promise((resolve) => waiters.push([predicate, resolve]));
  return { log, until };
}

test("streams a request's text and its done frame", { timeout: TIMEOUT }, async () => {
  const client = new WsClient(SERVER);
  try {
    // Made while still connecting: sent once the hello arrives.
    const stream = client.generate({ prompt: "hello node", max_tokens: 40, seed: 3, top_p: null });
    const events = [];
    stream.on("started", () => events.push("started"));
    let text = "";
    let pieces = 0;
    for await (const piece of stream) {
      text += piece;
      pieces += 1;
    }
    const done = await stream.done;
    assert.equal(text, await expectedText("hello node", 40, 3));
    assert.equal(stream.text, text);
    assert.ok(pieces >= 2, `only ${pieces} piece(s)`);
    assert.equal(done.reason, "length");
    assert.equal(done.usage.completion_tokens, 40);
    assert.equal(typeof done.timings.total_ms, "number");
    assert.deepEqual(events, ["started"]);
    assert.equal(stream.status, "done");
    assert.equal(client.hello?.model, "fake");
    assert.equal(client.hello?.protocol, 1);
  } finally {
    client.close();
  }
});

test("several choices (n): each choice's text, a choice_done each, one done", { timeout: TIMEOUT }, async () => {
  const client = new WsClient(SERVER, { resumable: true });
  try {
    const stream = client.generate({ prompt: "hello node", max_tokens: 8, seed: 3, n: 2 });
    const ends = [];
    stream.on("choiceDone", (frame) => ends.push(frame.choice));
    const done = await stream.done;
    assert.equal(done.usage.completion_tokens, 16);
    assert.deepEqual(stream.choiceTexts, [
      await expectedText("hello node", 8, 3),
      await expectedText("hello node", 8, 4),
    ]);
    assert.deepEqual(ends.sort(), [0, 1]);
    assert.equal(stream.choiceEnds.length, 2);
  } finally {
    client.close();
  }
});

test("a request names its model: done says which answered; an unknown one is refused", { timeout: TIMEOUT }, async () => {
  const client = new WsClient(SERVER);
  try {
    const stream = client.generate({ prompt: "hello", max_tokens: 3, model: "fake" });
    const done = await stream.done;
    assert.equal(done.model, "fake");
    assert.deepEqual(client.hello?.models?.map((m) => [m.name, m.state]), [["fake", "loaded"]]);
    const refused = client.generate({ prompt: "hello", max_tokens: 3, model: "nope" });
    await assert.rejects(refused.done, (error) => error instanceof WsError && error.code === "model_not_found");
  } finally {
    client.close();
  }
});

test("cancel is in-band: done(cancelled) at once, no text after it", { timeout: TIMEOUT }, async () => {
  const client = new WsClient(SERVER);
  try {
    await client.ready();
    const before = (await control("cancelled")).count;
    const stream = client.generate({ prompt: "cancel me", max_tokens: 100000 });
    const seen = [];
    let done = null;
    let textAtCancel = null;
    for await (const piece of stream) {
      seen.push(piece);
      const cancelling = stream.cancel();
      textAtCancel = stream.text;
      done = await cancelling;
    }
    assert.equal(seen.length, 1, "the loop ended at the cancel");
    assert.equal(done?.reason, "cancelled");
    assert.equal(stream.text, textAtCancel, "no text was accepted after the cancel");
    assert.ok(stream.text.startsWith(seen[0]));
    // The server ended the request because of our cancel frame, not a disconnect.
    assert.equal((await control("cancelled")).count, before + 1);
    // The connection stays usable.
    const after = await client.generate({ prompt: "after", max_tokens: 5 }).result();
    assert.equal(after.text, await expectedText("after", 5));
    assert.equal(after.done.reason, "length");

    // Leaving the loop early cancels too.
    const broken = client.generate({ prompt: "break", max_tokens: 100000 });
    for await (const _ of broken) break;
    assert.equal((await broken.done).reason, "cancelled");
  } finally {
    client.close();
  }
});

test("restart regenerates from the same input; the old stream gets nothing more", { timeout: TIMEOUT }, async () => {
  const client = new WsClient(SERVER);
  try {
    const old = client.generate({ prompt: "restart me", max_tokens: 100000, seed: 2 });
    const iterator = old[Symbol.asyncIterator]();
    const first = await iterator.next();
    assert.equal(first.done, false);
    const again = client.restart(old, { max_tokens: 20 });
    assert.equal(again.frame.type, "restart", "one in-band restart frame on the same connection");
    const oldTextAtRestart = old.text;
    const { text, done } = await again.result();
    assert.equal(text, await expectedText("restart me", 20, 2));
    assert.equal(done.reason, "length");
    assert.equal((await old.done).reason, "cancelled");
    assert.equal(old.text, oldTextAtRestart);
    assert.deepEqual(await iterator.next(), { value: undefined, done: true });
  } finally {
    client.close();
  }
});

test("a connection the server aborts: the request fails, is not replayed, the client reconnects", { timeout: TIMEOUT }, async () => {
  /** @type {any[]} */
  const sent = [];
  class LoggingWebSocket extends WebSocket {
    /** @param {string} data */
    send(data) {
      sent.push(JSON.parse(data));
      super.send(data);
    }
  }
  const client = new WsClient(SERVER, {
    WebSocket: LoggingWebSocket,
    reconnect: { initialDelayMs: 20, jitter: 0 },
  });
  const states = stateLog(client);
  try {
    await client.ready();
    const stream = client.generate({ prompt: "in flight", max_tokens: 100000 });
    const outcome = (async () => {
      try {
        for await (const _ of stream);
        return null;
      } catch (error) {
        return error;
      }
    })();
    await firstDelta(stream);
    assert.equal((await control("drop", "POST")).dropped, 1);

    const error = await outcome;
    assert.ok(error instanceof WsError, String(error));
    assert.equal(error.code, "connection_lost");
    await assert.rejects(stream.done, (e) => e instanceof WsError && e.code === "connection_lost");
    assert.equal(stream.status, "failed");

    await states.until((log) => log.filter((e) => e.state === "open").length >= 2);
    const next = await client.generate({ prompt: "after the drop", max_tokens: 5 }).result();
    assert.equal(next.done.reason, "length");
    assert.deepEqual(
      states.log.slice(0, 4).map((e) => e.state),
      ["open", "reconnecting", "connecting", "open"],
    );
    const generates = sent.filter((f) => f.type === "generate").map((f) => f.id);
    assert.deepEqual(generates, [stream.id, generates[1]], "sent once, never replayed");
    // A restart after the reconnect cannot be in-band (the server forgot the
    // old request): the client sends the remembered input as a new generate.
    const again = client.restart(stream, { max_tokens: 6 });
    assert.equal(again.frame.type, "generate");
    assert.equal((await again.result()).text, await expectedText("in flight", 6));
  } finally {
    client.close();
  }
});

test("a resumable request rides over a server-side abort: no gap, no duplicate", { timeout: TIMEOUT }, async () => {
  /** @type {any[]} */
  const sent = [];
  class LoggingWebSocket extends WebSocket {
    /** @param {string} data */
    send(data) {
      sent.push(JSON.parse(data));
      super.send(data);
    }
  }
  const client = new WsClient(SERVER, {
    WebSocket: LoggingWebSocket,
    reconnect: { initialDelayMs: 20, jitter: 0 },
    resumable: true,
  });
  /** @type {any[]} */
  const reconnects = [];
  client.on("reconnect", (event) => reconnects.push(event));
  /** @type {number[]} */
  const seqs = [];
  client.on("frame", (frame) => {
    if (frame.type === "delta") seqs.push(frame.seq);
  });
  try {
    await client.ready();
    const stream = client.generate({ prompt: "ride over", max_tokens: 150, seed: 3 });
    /** @type {any[]} */
    const resumed = [];
    stream.on("resumed", (event) => resumed.push(event));
    let pieces = "";
    let dropped = false;
    for await (const text of stream) {
      pieces += text;
      if (!dropped) {
        dropped = true;
        assert.ok(stream.resumeToken && stream.resumeToken.length >= 22);
        assert.equal((await control("drop", "POST")).dropped, 1);
      }
    }
    const done = await stream.done;
    assert.equal(done.reason, "length");
    assert.equal(pieces, await expectedText("ride over", 150, 3));
    assert.equal(stream.text, pieces);
    assert.equal(reconnects.length, 1);
    assert.deepEqual(reconnects[0].resumed, [stream.id]);
    assert.equal(resumed.length, 1);
    const resumes = sent.filter((f) => f.type === "resume");
    assert.equal(resumes.length >= 1, true);
    assert.equal(resumes[0].id, stream.id);
    assert.equal(resumes[0].after_seq, resumed[0].afterSeq);
    // The server replays only what may not have arrived: seq never repeats.
    assert.equal(new Set(seqs).size, seqs.length, `seqs ${seqs}`);
    assert.equal(sent.filter((f) => f.type === "generate").length, 1, "sent once, never replayed");
  } finally {
    client.close();
  }
});

test("client.resume() picks up a request another client started (a page reload)", { timeout: TIMEOUT }, async () => {
  const first = new WsClient(SERVER, { reconnect: false, resumable: true });
  const second = new WsClient(SERVER, { connect: false });
  try {
    await first.ready();
    const stream = first.generate({ prompt: "reload me", max_tokens: 120, seed: 5 });
    await firstDelta(stream);
    // What a page keeps in sessionStorage: id, token, last seq, and the text so far.
    const saved = { id: stream.id, resumeToken: String(stream.resumeToken), afterSeq: stream.lastSeq };
    const before = stream.text;
    first.close(); // the page goes away; the server detaches the request
    second.connect();
    const again = second.resume(saved);
    const rest = await again.result();
    assert.equal(rest.done.reason, "length");
    assert.equal(before + rest.text, await expectedText("reload me", 120, 5));
  } finally {
    first.close();
    second.close();
  }
});

test("a server that shuts down and comes back: backoff, then open again", { timeout: TIMEOUT }, async () => {
  const client = new WsClient(SERVER, {
    reconnect: { initialDelayMs: 20, factor: 2, maxDelayMs: 160, jitter: 0 },
  });
  const states = stateLog(client);
  try {
    await client.ready();
    await control("stop", "POST"); // closes every connection with 1001
    await states.until((log) => log.filter((e) => e.state === "reconnecting").length >= 5);
    await control("start", "POST");
    await client.ready();
    const retries = states.log.filter((e) => e.state === "reconnecting");
    assert.equal(retries[0].code, 1001, "the server's going-away close");
    assert.deepEqual(
      retries.slice(0, 5).map((e) => e.delayMs),
      [20, 40, 80, 160, 160],
    );
    assert.deepEqual(
      retries.slice(0, 5).map((e) => e.attempt),
      [1, 2, 3, 4, 5],
    );
    const result = await client.generate({ prompt: "back", max_tokens: 4 }).result();
    assert.equal(result.text, await expectedText("back", 4));
  } finally {
    client.close();
  }
});

test("a pull where the server allows none is refused: done rejects with its code", { timeout: TIMEOUT }, async () => {
  const client = new WsClient(SERVER, { reconnect: false });
  try {
    const hello = await client.ready();
    assert.equal(hello.pull, false);
    const seen = [];
    const pull = client.pull("ggml-org/gemma-3-1b-it-GGUF", { onProgress: (p) => seen.push(p) });
    await assert.rejects(pull.done, (error) => error instanceof WsError && error.code === "pull_not_allowed");
    assert.deepEqual(seen, []);
    assert.equal(pull.progress, null);
    // A refused pull touches nothing: its id is free again, as a refused generate's.
    const reused = client.generate({ prompt: "x", max_tokens: 2 }, { id: pull.id });
    assert.equal((await reused.done).reason, "length");
    // A pull cancelled before it went out ends as cancelled, locally.
    const offline = new WsClient(SERVER, { connect: false, reconnect: false });
    const early = offline.pull("org/repo");
    assert.equal((await early.cancel()).reason, "cancelled");
    offline.close();
  } finally {
    client.close();
  }
});

/**
 * The fake engine's vector of a text (wsserver/backends/fake_embed.py):
 * 16 components from its SHA-256, as float32.
 *
 * @param {string} text
 * @returns {number[]}
 */
function fakeVector(text) {
  const digest = createHash("sha256").update(text, "utf8").digest();
  const values = new Float32Array(16);
  for (let i = 0; i < 16; i++) values[i] = (digest[2 * i] * 256 + digest[2 * i + 1]) / 32768 - 1;
  return Array.from(values);
}

test("embed resolves with each input's vector; a refusal rejects with its code", { timeout: TIMEOUT }, async () => {
  const client = new WsClient(SERVER, { reconnect: false });
  try {
    await client.ready();
    const result = await client.embed(["hello", "café"]);
    assert.deepEqual(result.vectors, [fakeVector("hello"), fakeVector("café")]);
    assert.equal(result.model, "fake");
    assert.equal(result.promptTokens, 2);
    await assert.rejects(
      client.embed("x", { model: "nope" }),
      (error) => error instanceof WsError && error.code === "model_not_found",
    );
    await assert.rejects(
      client.embed(""),
      (error) => error instanceof WsError && error.code === "bad_request",
    );
    // Aborted before it went out: rejected as cancelled, locally.
    const aborted = new AbortController();
    aborted.abort();
    await assert.rejects(
      client.embed("y", { signal: aborted.signal }),
      (error) => error instanceof WsError && error.code === "cancelled",
    );
  } finally {
    client.close();
  }
});
