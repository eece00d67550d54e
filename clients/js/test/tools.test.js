// wsserver.js's reasoning and tool calls under Node.js, against a real
// wsserver whose fake engine echoes the last user message as the model's
// output (`backend.fake.echo`): the test writes what "the model" says — a
// think block, an answer, Hermes <tool_call> blocks — the server splits and
// parses it, and the client must give it back typed.
//
// Run by tests/test_js_node.py (WSSERVER_URL, WSSERVER_CONTROL and
// WSSERVER_TEST_UNIT as for wsserver.test.js). No timer waits: every wait is
// on an event of the client or the control endpoint's answer.

import { test } from "node:test";
import assert from "node:assert/strict";

import { ToolCall, WsClient, WsError } from "../wsserver.js";

const SERVER = process.env.WSSERVER_URL;
const CONTROL = process.env.WSSERVER_CONTROL;
if (!SERVER || !CONTROL) {
  throw new Error("run through tests/test_js_node.py (scripts/test): it starts the server");
}
const UNIT = Number(process.env.WSSERVER_TEST_UNIT ?? "1");
const TIMEOUT = 30_000 * UNIT;

const TOOLS = [
  {
    type: "function",
    function: {
      name: "get_weather",
      parameters: { type: "object", properties: { city: { type: "string" }, days: { type: "integer" } } },
    },
  },
  { type: "function", function: { name: "get_time", parameters: { type: "object" } } },
];
const REASONING = "The user wants the weather in Tōkyō; I should call the tool 😀.";
const SCRIPT =
  `<think>${REASONING}</think>\n\nLet me check. ` +
  '<tool_call>{"name": "get_weather", "arguments": {"city": "Tōkyō", "days": 3}}</tool_call>' +
  '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>';

/** @param {string} content */
const chat = (content) => [{ role: /** @type {const} */ ("user"), content }];

/** @param {ToolCall[]} calls */
function assertTheCalls(calls) {
  assert.deepEqual(
    calls.map((c) => [c.index, c.name]),
    [
      [0, "get_weather"],
      [1, "get_time"],
    ],
  );
  assert.ok(calls.every((c) => c instanceof ToolCall && c.id.startsWith("call_")));
  assert.notEqual(calls[0].id, calls[1].id);
  assert.deepEqual(calls[0].parsedArguments, { city: "Tōkyō", days: 3 });
  assert.equal(calls[0].argumentsError, null);
  assert.deepEqual(calls[1].parsedArguments, {});
}

test("reasoning, text and tool calls arrive apart, typed and in order", { timeout: TIMEOUT }, async () => {
  const client = new WsClient(SERVER);
  try {
    /** @type {string[]} */
    const order = [];
    let reasoning = "";
    /** @type {Map<ToolCall, string>} */
    const parts = new Map();
    const stream = client.generate(
      { messages: chat(SCRIPT), tools: TOOLS, tool_choice: "auto", parallel_tool_calls: true, reasoning_format: "auto" },
      {
        onReasoning: (text) => {
          order.push("reasoning");
          reasoning += text;
        },
        onDelta: () => order.push("text"),
        onToolCall: ({ call, arguments: added }) => {
          order.push("toolCall");
          parts.set(call, (parts.get(call) ?? "") + added);
        },
      },
    );
    assert.deepEqual(stream.frame.tools, TOOLS);
    let text = "";
    for await (const piece of stream) {
      assert.notEqual(piece, "", "iteration yields no empty piece");
      text += piece;
    }
    const done = await stream.done;
    assert.equal(done.reason, "tool_calls");
    assert.ok((done.usage.reasoning_tokens ?? 0) > 0);
    assert.equal(text, "Let me check. ");
    assert.equal(stream.text, text);
    assert.equal(reasoning, REASONING);
    assert.equal(stream.reasoning, REASONING);
    // Reasoning first, then the text, then the calls: the protocol's order.
    const firstText = order.indexOf("text");
    assert.ok(firstText > 0 && order.slice(0, firstText).every((k) => k === "reasoning"), order.join());
    assert.ok(order.indexOf("toolCall") > firstText, order.join());
    assertTheCalls(stream.toolCalls);
    for (const call of stream.toolCalls) assert.equal(parts.get(call), call.arguments);
  } finally {
    client.close();
  }
});

test("result() and message(): the calls go back with their results in the next turn", { timeout: TIMEOUT }, async () => {
  const client = new WsClient(SERVER);
  try {
    const stream = client.generate({ messages: chat(SCRIPT), tools: TOOLS });
    const first = await stream.result();
    assert.equal(first.reasoning, REASONING);
    assertTheCalls(first.toolCalls);
    const message = stream.message();
    assert.equal(message.content, "Let me check. ");
    assert.equal(message.reasoning, REASONING); // the loop goes on, with its reasoning
    assert.deepEqual(message.tool_calls?.[1], {
      id: first.toolCalls[1].id,
      type: "function",
      function: { name: "get_time", arguments: "{}" },
    });
    const history = [
      ...chat(SCRIPT),
      message,
      { role: /** @type {const} */ ("tool"), tool_call_id: first.toolCalls[0].id, content: "sunny" },
      { role: /** @type {const} */ ("tool"), tool_call_id: first.toolCalls[1].id, content: "noon" },
      ...chat("Sunny at noon."),
    ];
    const second = client.generate({ messages: history, tools: TOOLS });
    const result = await second.result();
    assert.equal(result.text, "Sunny at noon.");
    assert.deepEqual(result.toolCalls, []);
    assert.equal(result.done.reason, "stop");
    assert.deepEqual(second.message(), { role: "assistant", content: "Sunny at noon." });
  } finally {
    client.close();
  }
});

test("an unreadable call is the server's invalid_tool_call, never a call", { timeout: TIMEOUT }, async () => {
  const client = new WsClient(SERVER);
  try {
    const bad = '<tool_call>{"name": "get_weather", "arguments": {city: 1}}</tool_call>';
    const stream = client.generate({ messages: chat(bad), tools: TOOLS });
    await assert.rejects(
      (async () => {
        for await (const _ of stream) {
          // nothing arrives
        }
      })(),
      (error) => error instanceof WsError && error.code === "invalid_tool_call",
    );
    // A call streams as it is read: its start may have come before the
    // error, never as a call whose arguments parse.
    for (const call of stream.toolCalls) assert.notEqual(call.argumentsError, null);
    assert.equal((await stream.done).reason, "error");
  } finally {
    client.close();
  }
});

test("a ToolCall says why arguments do not parse", () => {
  const cut = new ToolCall(0, "call_1", "get_weather", '{"city": "Os');
  assert.equal(cut.parsedArguments, null);
  assert.match(String(cut.argumentsError), /^the arguments are not valid JSON: /);
  assert.equal(new ToolCall(0, "c", "f", "[1]").argumentsError, "the arguments are JSON but not an object: an array");
  assert.equal(new ToolCall(0, "c", "f", "null").argumentsError, "the arguments are JSON but not an object: null");
  cut.arguments += 'lo"}';
  assert.deepEqual(cut.parsedArguments, { city: "Oslo" });
});

test("resumed after a reload mid-reasoning: nothing lost, nothing twice", { timeout: TIMEOUT }, async () => {
  const longReasoning = Array.from({ length: 40 }, (_, i) => `Step ${i}: think it over.`).join(" ");
  const script = SCRIPT.replace(REASONING, longReasoning);
  const first = new WsClient(SERVER, { reconnect: false, resumable: true });
  const second = new WsClient(SERVER, { connect: false });
  try {
    await first.ready();
    const stream = first.generate({ messages: chat(script), tools: TOOLS, max_tokens: 2000 });
    await new Promise((resolve) => {
      const off = stream.on("reasoning", () => {
        off();
        resolve(undefined);
      });
    });
    // What a page keeps across a reload: id, token, last seq, what it showed.
    const saved = {
      id: stream.id,
      resumeToken: String(stream.resumeToken),
      afterSeq: stream.lastSeq,
      toolCalls: stream.toolCalls.map(({ index, id, name, arguments: args }) => ({ index, id, name, arguments: args })),
    };
    const before = { reasoning: stream.reasoning, text: stream.text };
    assert.ok(before.reasoning.length < longReasoning.length, "still reasoning at the reload");
    first.close();
    second.connect();
    const again = second.resume(saved);
    const rest = await again.result();
    assert.equal(rest.done.reason, "tool_calls");
    assert.equal(before.reasoning + rest.reasoning, longReasoning);
    assert.equal(before.text + rest.text, "Let me check. ");
    assertTheCalls(rest.toolCalls);
  } finally {
    first.close();
    second.close();
  }
});
