// The renderer: the same module and the same rendering rule as the web page —
// buffer the text, append it once per animation frame.
import { WsClient } from "./wsserver.js";

const $ = (id) => document.getElementById(id);
const { url, token } = await window.wsserverConfig.get();
const client = new WsClient(url, { token });

client.on("state", ({ state, delayMs }) => {
  $("status").textContent =
    state === "reconnecting" ? `Disconnected; retrying in ${Math.round(delayMs / 100) / 10} s` : state;
});

let stream = null;
let pending = "";
let frame = 0;

function flush() {
  frame = 0;
  $("answer").append(pending);
  pending = "";
}

$("send").addEventListener("click", async () => {
  stream?.cancel();
  $("answer").replaceChildren();
  const current = (stream = client.generate({ prompt: $("prompt").value, max_tokens: 256 }));
  $("stop").disabled = false;
  try {
    for await (const text of current) {
      pending += text;
      frame ||= requestAnimationFrame(flush);
    }
    const done = await current.done;
    $("status").textContent = `${done.reason}: ${done.usage.completion_tokens} tokens, ${done.timings.tokens_per_s.toFixed(1)} tok/s`;
  } catch (error) {
    $("status").textContent = `failed: ${error.message}`;
  } finally {
    if (stream === current) $("stop").disabled = true;
  }
});

$("stop").addEventListener("click", () => stream?.cancel());
