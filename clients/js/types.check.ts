// Never run: compiled by `tsc -p clients/js` (scripts/lint, tests/test_js_node.py).
//
// wsserver.js checks itself against wsserver.d.ts (its `declaredExports`);
// this file checks the other direction: that the declarations, as a
// TypeScript user imports them, still describe the API the READMEs document.

import {
  WsClient,
  WsError,
  PROTOCOL_VERSION,
  ToolCall,
  type ChatMessage,
  type DoneFrame,
  type HelloFrame,
  type ImageInput,
  type Tool,
} from "./wsserver.js";

export async function documentedUsage(output: { append(text: string): void }): Promise<void> {
  const client = new WsClient("ws://127.0.0.1:8765/", {
    reconnect: { initialDelayMs: 250, maxDelayMs: 10_000, factor: 2, jitter: 0.25 },
  });
  const off = client.on("state", ({ state, attempt, delayMs }) => {
    const s: "connecting" | "open" | "reconnecting" | "closed" = state;
    void [s, attempt, delayMs];
  });
  const hello: HelloFrame = await client.ready();
  const protocol: number = hello.protocol === PROTOCOL_VERSION ? hello.protocol : 0;
  void protocol;

  const picture: ImageInput = new Blob([new Uint8Array([137, 80, 78, 71])], { type: "image/png" });
  const looked = client.generate({
    model: "llava",
    messages: [{ role: "user", content: "What is in this picture?", images: [picture, new Uint8Array(4)] }],
  });
  void looked;

  const stream = client.generate({ prompt: "Once upon a time", max_tokens: 200, temperature: 0.8 });
  stream.on("queued", ({ position }) => void position);
  for await (const text of stream) output.append(text);
  const done: DoneFrame = await stream.done;
  const tokens: number = done.usage.completion_tokens + done.timings.tokens_per_s;
  void tokens;

  const controller = new AbortController();
  const long = client.generate(
    { messages: [{ role: "user", content: "Write a long story." }], stop: ["\n\n"] },
    { signal: controller.signal, onDelta: (text: string) => output.append(text) },
  );
  const cancelled: DoneFrame = await long.cancel();
  const again = client.restart(long, { seed: 7 });
  const { text, done: againDone } = await again.result();
  void [cancelled, text, againDone.reason];
  const byId: DoneFrame | null = await client.cancel(again.id);
  void byId;

  try {
    await client.generate({ prompt: "x" }).result();
  } catch (error) {
    if (error instanceof WsError && error.code === "connection_lost") output.append(error.message);
  }
  // Reasoning and tool calls (clients/js/README.md, "Reasoning and tool calls").
  const tools: Tool[] = [{ type: "function", function: { name: "get_weather", parameters: { type: "object" } } }];
  const messages: ChatMessage[] = [{ role: "user", content: "Weather in Paris?" }];
  const turn = client.generate(
    { messages, tools, tool_choice: "auto", parallel_tool_calls: false, reasoning_format: "auto" },
    { onReasoning: (thinking: string) => output.append(thinking) },
  );
  turn.on("toolCall", ({ call, arguments: added }) => void [call.name, added]);
  const answer = await turn.result();
  const reasoning: string = answer.reasoning + turn.reasoning;
  for (const call of answer.toolCalls) {
    const args: Record<string, unknown> | null = call.parsedArguments;
    const why: string | null = call.argumentsError;
    const same: boolean = call instanceof ToolCall && call.index >= 0;
    messages.push({ role: "tool", tool_call_id: call.id, content: JSON.stringify(args ?? why) });
    void same;
  }
  messages.splice(1, 0, turn.message());
  void reasoning;

  if (hello.pull) {
    const pull = client.pull("ggml-org/gemma-3-1b-it-GGUF:Q4_K_M", {
      onProgress: ({ status, completed, total, rate, eta_s }) => void [status, completed, total, rate, eta_s],
    });
    const ended = await pull.done;
    const served: string | undefined = ended.reason === "complete" ? ended.model?.name : ended.error?.code;
    void [served, pull.progress?.completed];
    await pull.cancel();
  }

  off();
  client.close();
}
