// wsserver.js's images under Node.js, against a real wsserver serving the
// tiny vision model (a tiny llama and a tiny LLaVA projector: tests/tiny_mmproj.py)
// as "seer", beside the text-only "tiny".
//
// Run by tests/test_js_node.py, which also gives the images (WSSERVER_RED and
// WSSERVER_GRADIENT: PNGs as base64). The answers are compared with what
// OpenAI's chat API on the same server gives for the same image and prompt.

import { test } from "node:test";
import assert from "node:assert/strict";

import { WsClient, WsError } from "../wsserver.js";

const SERVER = process.env.WSSERVER_URL;
if (!SERVER || !process.env.WSSERVER_RED || !process.env.WSSERVER_GRADIENT) {
  throw new Error("run through tests/test_js_node.py (scripts/test): it starts the server");
}
const UNIT = Number(process.env.WSSERVER_TEST_UNIT ?? "1");
const TIMEOUT = 60_000 * UNIT;
const HTTP = SERVER.replace(/^ws/, "http");
const RED = Uint8Array.from(Buffer.from(process.env.WSSERVER_RED, "base64"));
const GRADIENT = Uint8Array.from(Buffer.from(process.env.WSSERVER_GRADIENT, "base64"));
const OPTIONS = { model: "seer", max_tokens: 12, temperature: 0 };

/** @param {import("../wsserver.d.ts").ImageInput[]} images */
const asking = (images, model = "seer") => ({
  ...OPTIONS,
  model,
  messages: [{ role: /** @type {const} */ ("user"), content: "Look at", images }],
});

/** OpenAI's chat API's answer for `image` before the same text. @param {Uint8Array} image */
async function openai(image) {
  const url = "data:image/png;base64," + Buffer.from(image).toString("base64");
  const response = await fetch(`${HTTP}v1/chat/completions`, {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify({
      ...OPTIONS,
      messages: [
        {
          role: "user",
          content: [
            { type: "image_url", image_url: { url } },
            { type: "text", text: "Look at" },
          ],
        },
      ],
    }),
  });
  assert.equal(response.status, 200);
  const body = await response.json();
  return { text: body.choices[0].message.content, promptTokens: body.usage.prompt_tokens };
}

test("a Uint8Array, an ArrayBuffer and a Blob read as OpenAI's wire reads the image", { timeout: TIMEOUT }, async () => {
  const client = new WsClient(SERVER);
  try {
    const hello = await client.ready();
    assert.ok(hello.limits.max_upload_bytes > 0);
    const expected = await openai(RED);
    const fromBytes = await client.generate(asking([RED])).result();
    assert.equal(fromBytes.text, expected.text);
    assert.equal(fromBytes.done.usage.prompt_tokens, expected.promptTokens);
    const buffer = RED.buffer.slice(RED.byteOffset, RED.byteOffset + RED.byteLength);
    assert.equal((await client.generate(asking([buffer])).result()).text, expected.text);
    const blob = new Blob([RED], { type: "image/png" });
    assert.equal((await client.generate(asking([blob])).result()).text, expected.text);
    const base64 = Buffer.from(RED).toString("base64");
    assert.equal((await client.generate(asking([base64])).result()).text, expected.text);
    // Another image, another answer (and the same as OpenAI's for it).
    const other = await client.generate(asking([new Blob([GRADIENT])])).result();
    assert.equal(other.text, (await openai(GRADIENT)).text);
    assert.notEqual(other.text, expected.text);
    // A regenerate on the same connection runs the kept input, image and all.
    const again = await client.restart(fromBytes.done.id, { temperature: 0 }).result();
    assert.equal(again.text, expected.text);
  } finally {
    client.close();
  }
});

test("refusals name the image", { timeout: TIMEOUT }, async () => {
  const client = new WsClient(SERVER);
  try {
    await client.ready();
    /** @param {import("../wsserver.d.ts").GenerateParams} params */
    const refusal = async (params) => {
      const error = await client
        .generate(params)
        .result()
        .then(
          () => null,
          (e) => e,
        );
      assert.ok(error instanceof WsError, String(error));
      return error;
    };
    let error = await refusal(asking([RED, { upload: "nope" }]));
    assert.equal(error.code, "bad_request");
    assert.match(error.message, /image 1 \(messages\[0\]\.images\[1\]\): no upload 'nope'/);
    error = await refusal(asking([new TextEncoder().encode("no image")]));
    assert.match(error.message, /image 0 \(messages\[0\]\.images\[0\]\): not a PNG/);
    error = await refusal(asking([RED], "tiny"));
    assert.match(error.message, /image 0: model tiny takes no images/);
    error = await refusal(asking([/** @type {any} */ (42)]));
    assert.match(error.message, /messages\[0\]\.images\[0\]: an image is a Blob/);
    // The connection serves on.
    assert.ok((await client.generate(asking([RED])).result()).text);
  } finally {
    client.close();
  }
});
