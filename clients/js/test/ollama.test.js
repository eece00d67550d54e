// Ollama's official npm client (`ollama`, a dev dependency here) against a
// real wsserver's Ollama API, under Node.js. The fake engine echoes the last
// user message as the model's output (`backend.fake.echo`), so each test
// writes what "the model" says — a think block, a tool call — and checks how
// the client reads it back. One slot (`parallel` 1): a request that is not
// freed would hold up the next one.
//
// Run by tests/test_ollama_npm.py (WSSERVER_URL, WSSERVER_CONTROL and
// WSSERVER_TEST_UNIT as for wsserver.test.js). No timer waits.

import { test } from "node:test";
import assert from "node:assert/strict";

import { Ollama } from "ollama";

const SERVER = process.env.WSSERVER_URL;
const CONTROL = process.env.WSSERVER_CONTROL;
if (!SERVER || !CONTROL) {
  throw new Error("run through tests/test_ollama_npm.py (scripts/test): it starts the server");
}
const HOST = SERVER.replace(/^ws/, "http").replace(/\/$/, "");
const UNIT = Number(process.env.WSSERVER_TEST_UNIT ?? "1");
const TIMEOUT = 30_000 * UNIT;
const MODEL = "fake";

async function control(path) {
  const response = await fetch(CONTROL + path);
  return response.json();
}

const client = () => new Ollama({ host: HOST });

/** @param {any} last */
function checkDurations(last) {
  assert.equal(last.done, true);
  assert.ok(last.total_duration > 0);
  const parts = last.load_duration + last.prompt_eval_duration + last.eval_duration;
  assert.ok(Math.abs(parts - last.total_duration) <= 3, JSON.stringify(last));
}

test("chat, whole and streamed, and generate", { timeout: TIMEOUT }, async () => {
  const ollama = client();
  const messages = [{ role: "user", content: "Hello from Node, 😀 and 日本." }];
  const whole = await ollama.chat({ model: MODEL, messages });
  assert.equal(whole.message.role, "assistant");
  assert.equal(whole.message.content, messages[0].content);
  assert.equal(whole.done_reason, "stop");
  assert.ok(whole.eval_count > 0 && whole.prompt_eval_count > 0);
  checkDurations(whole);

  const parts = [];
  for await (const part of await ollama.chat({ model: `${MODEL}:latest`, messages, stream: true })) {
    parts.push(part);
  }
  assert.equal(parts.map((p) => p.message.content).join(""), messages[0].content);
  assert.deepEqual(
    parts.map((p) => p.done),
    [...Array(parts.length - 1).fill(false), true],
  );
  checkDurations(parts.at(-1));

  const generated = await ollama.generate({ model: MODEL, prompt: "Echo me", options: { num_predict: 50 } });
  assert.equal(generated.response, "Echo me");
});

test("thinking and a tool call come back typed", { timeout: TIMEOUT }, async () => {
  const ollama = client();
  const script =
    "<think>The user wants the weather.</think>" +
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Tōkyō"}}</tool_call>';
  const tools = [
    {
      type: "function",
      function: {
        name: "get_weather",
        description: "The weather in a city.",
        parameters: { type: "object", properties: { city: { type: "string" } }, required: ["city"] },
      },
    },
  ];
  const reply = await ollama.chat({
    model: MODEL,
    messages: [{ role: "user", content: script }],
    tools,
    think: true,
  });
  assert.equal(reply.message.thinking, "The user wants the weather.");
  assert.equal(reply.message.tool_calls.length, 1);
  assert.equal(reply.message.tool_calls[0].function.name, "get_weather");
  assert.deepEqual(reply.message.tool_calls[0].function.arguments, { city: "Tōkyō" });
  assert.equal(reply.done_reason, "stop");
});

test("format with a schema gives JSON that has its properties", { timeout: TIMEOUT }, async () => {
  const schema = {
    type: "object",
    properties: { name: { type: "string" }, legs: { type: "integer" } },
    required: ["name", "legs"],
  };
  const reply = await client().chat({
    model: MODEL,
    messages: [{ role: "user", content: "a pet" }],
    format: schema,
    options: { seed: 3 },
  });
  const pet = JSON.parse(reply.message.content);
  assert.equal(typeof pet.name, "string");
  assert.ok(Number.isInteger(pet.legs));
});

test("list, show and ps", { timeout: TIMEOUT }, async () => {
  const ollama = client();
  const listed = await ollama.list();
  assert.deepEqual(
    listed.models.map((m) => m.model),
    [`${MODEL}:latest`],
  );
  const shown = await ollama.show({ model: MODEL });
  assert.ok(shown.capabilities.includes("completion"));
  const ps = await ollama.ps();
  assert.equal(ps.models[0].model, `${MODEL}:latest`);
});

test("abort() mid-stream cancels the request and frees the model", { timeout: TIMEOUT }, async () => {
  const ollama = client();
  const before = (await control("cancelled")).count;
  const long = "word ".repeat(5000);
  const stream = await ollama.chat({ model: MODEL, messages: [{ role: "user", content: long }], stream: true });
  let got = 0;
  await assert.rejects(async () => {
    for await (const part of stream) {
      got += part.message.content.length;
      stream.abort();
    }
  }, /abort/i);
  assert.ok(got > 0);
  // One slot: this answer comes only once the aborted request is gone.
  const next = await ollama.chat({ model: MODEL, messages: [{ role: "user", content: "next" }] });
  assert.equal(next.message.content, "next");
  assert.equal((await control("cancelled")).count, before + 1);
});

test("errors are ResponseErrors with Ollama's status", { timeout: TIMEOUT }, async () => {
  const ollama = client();
  await assert.rejects(
    ollama.chat({ model: "nope", messages: [{ role: "user", content: "x" }] }),
    (error) => error.status_code === 404 && /model 'nope' not found/.test(error.error),
  );
  await assert.rejects(
    ollama.chat({ model: MODEL, messages: [{ role: "user", content: "x" }], options: { mirostat: 2 } }),
    (error) => error.status_code === 400 && /options\.mirostat/.test(error.error),
  );
  await assert.rejects(ollama.delete({ model: MODEL }), (error) => error.status_code === 501);
});
