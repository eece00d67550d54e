/**
 * The wsserver chat page.
 *
 * Rendering is decoupled from the network: text that arrives between two
 * animation frames is collected and rendered once per frame, as markdown
 * (markdown.js): finished blocks are rendered once and kept, only the open
 * block is re-rendered, so the cost of a frame grows neither with the token
 * rate nor with the length of the answer, and typing and clicking stay
 * responsive however fast the model streams. `?render=plain` shows answers
 * as plain text instead (the benchmark compares the two).
 *
 * Conversations (store.js) are sent as `messages` (the history and the new
 * message), kept in localStorage and restored on reload. The last user
 * message can be edited and sent again; Regenerate replaces the last answer;
 * New chat starts another conversation, and the earlier ones stay listed.
 *
 * Stop cancels in-band and returns the UI to idle at once; the server's
 * `done` frame (with its timings) fills in the statistics when it arrives.
 * Regenerate restarts the last request; the JS client drops any late text of
 * the old request, and each answer's renderer only ever writes its own stream.
 *
 * On a server with several models (`hello.models`), the model picker in the
 * top bar chooses the current conversation's model: it is kept with the
 * conversation, every generate and restart of it names it, and a new chat
 * starts with the one picked last.
 *
 * The "Sampling" disclosure (sampling.js) holds temperature, the repetition
 * penalty, min_p and a JSON switch, kept in localStorage; every generate and
 * restart carries them (sampling.js says which, and why those defaults).
 *
 * The "Tools" disclosure (tools.js) holds function tools that every request
 * carries. An answer's reasoning shows in a collapsed "Thinking" block above
 * it, live while it streams; its tool calls as cards below it. Both are kept
 * with the conversation and survive a reload, also mid-answer.
 *
 * Answers are resumable: the JS client rides over a dropped connection, and a
 * reload mid-answer saves the stream's id, token and last seq in
 * sessionStorage (pagehide) so that the next page resumes it (resumeSaved).
 */

import { WsClient } from "/wsserver.js";
import { MarkdownView, PlainView } from "/markdown.js";
import { ConversationStore } from "/store.js";
import { DEFAULTS, RANGES, loadSettings, requestOptions, saveSettings, unhonoured, valid } from "/sampling.js";
import { appendMessage as appendTo, copy, markLastUser as markLastUserIn, showHistory as showHistoryIn } from "/log.js";
import { loadTools, parseTools, saveTools, setThinking, showToolCalls, storedCalls, thinkingBlock } from "/tools.js";
import { describeProgress, setupPulls } from "/pulls.js";
import { Attachments, dataUrlBytes, imageFiles, showImages } from "/attach.js";

/** @typedef {import("/wsserver.js").GenerationStream} GenerationStream */
/** @typedef {import("/wsserver.js").DoneFrame} DoneFrame */
/** @typedef {import("/wsserver.js").ChatMessage} ChatMessage */
/** @typedef {{text: string, reasoning: string}} Received what a resumed answer had before */

const $ = (/** @type {string} */ id) => /** @type {HTMLElement} */ (document.getElementById(id));

const ui = {
  app: $("app"),
  model: $("model"),
  modelPicker: /** @type {HTMLSelectElement} */ ($("model-picker")),
  connectionText: $("connection-text"),
  retry: /** @type {HTMLButtonElement} */ ($("retry")),
  conversation: $("conversation"),
  log: $("log"),
  empty: $("empty"),
  composer: /** @type {HTMLFormElement} */ ($("composer")),
  activity: $("activity"),
  ttft: $("stat-ttft"),
  rate: $("stat-rate"),
  tokens: $("stat-tokens"),
  prompt: /** @type {HTMLTextAreaElement} */ ($("prompt")),
  maxTokens: /** @type {HTMLInputElement} */ ($("max-tokens")),
  temperature: /** @type {HTMLInputElement} */ ($("temperature")),
  temperatureValue: /** @type {HTMLOutputElement} */ ($("temperature-value")),
  seed: /** @type {HTMLInputElement} */ ($("seed")),
  sampling: /** @type {HTMLDetailsElement} */ ($("sampling")),
  samplingSummary: $("sampling-summary"),
  samplingNote: $("sampling-note"),
  samplingReset: /** @type {HTMLButtonElement} */ ($("sampling-reset")),
  repeatPenalty: /** @type {HTMLInputElement} */ ($("repeat-penalty")),
  repeatLastN: /** @type {HTMLInputElement} */ ($("repeat-last-n")),
  minP: /** @type {HTMLInputElement} */ ($("min-p")),
  json: /** @type {HTMLInputElement} */ ($("json-mode")),
  toolsText: /** @type {HTMLTextAreaElement} */ ($("tools-json")),
  toolsSummary: $("tools-summary"),
  toolsNote: $("tools-note"),
  send: /** @type {HTMLButtonElement} */ ($("send")),
  stop: /** @type {HTMLButtonElement} */ ($("stop")),
  regenerate: /** @type {HTMLButtonElement} */ ($("regenerate")),
  newChat: /** @type {HTMLButtonElement} */ ($("new-chat")),
  history: $("history"),
  editing: $("editing"),
  cancelEdit: /** @type {HTMLButtonElement} */ ($("cancel-edit")),
  attach: /** @type {HTMLButtonElement} */ ($("attach")),
  imageInput: /** @type {HTMLInputElement} */ ($("image-input")),
  attachments: $("attachments"),
  attachNote: $("attach-note"),
};

/** How answers are shown: markdown, or plain text with `?render=plain`. */
const View = new URLSearchParams(location.search).get("render") === "plain" ? PlainView : MarkdownView;
const store = new ConversationStore();
/** The sampling settings: the disclosure's last valid values. */
const settings = loadSettings();
/** The "Tools" disclosure's tools (null: none sent) or why its text is not a list of tools. */
let toolsSetting = parseTools(loadTools());
/** Index in the conversation of the user message being edited, if any. @type {number | null} */
let editing = null;
/** The images the next message carries (attach.js). */
const attachments = new Attachments(ui.attachments, ui.attachNote, () => updateControls());

/** Live statistics are refreshed at most this often, so they stay readable. */
const STATS_INTERVAL_MS = 250;
/**
 * Delta frames carry text, not token counts, so the live token figures are
 * estimates: characters over characters-per-token, a ratio learnt from each
 * finished answer of this model (4, typical of English BPE, until then). The
 * server's exact counts replace them when `done` arrives.
 */
let charsPerToken = 4;
/** Within this many pixels of the bottom, new text keeps the view pinned there. */
const STICK_PX = 48;

// ------------------------------------------------------------------ connection

// Resumable: a dropped connection is ridden over by the client, and a reload
// mid-answer picks the answer up where it was (see RESUME_KEY below).
const client = new WsClient(`${location.protocol === "https:" ? "wss" : "ws"}://${location.host}/`, {
  token: takeToken(),
  resumable: true,
});

/**
 * The answer streaming when the page went away (a reload): its request id,
 * resume token, last seq and the text received up to it, and where it goes.
 * sessionStorage, not localStorage: it belongs to this tab, and the token is
 * a credential that should not outlive it.
 */
const RESUME_KEY = "wsserver.resume";

/**
 * A token can be given in the URL fragment (`/#token=…`), which never reaches
 * the server's logs; it is removed from the address bar at once.
 */
function takeToken() {
  const params = new URLSearchParams(location.hash.slice(1));
  const token = params.get("token");
  if (token === null) return undefined;
  history.replaceState(null, "", location.pathname + location.search);
  return token;
}

client.on("state", ({ state, attempt, delayMs }) => {
  ui.app.dataset.connection = state;
  ui.retry.hidden = state !== "reconnecting";
  if (state === "open") {
    ui.connectionText.textContent = "Connected";
  } else if (state === "connecting") {
    ui.connectionText.textContent = attempt > 0 ? `Connecting… (attempt ${attempt + 1})` : "Connecting…";
  } else if (state === "reconnecting") {
    const seconds = ((delayMs ?? 0) / 1000).toFixed(1);
    ui.connectionText.textContent = `Disconnected — retrying in ${seconds} s`;
  } else {
    ui.connectionText.textContent = "Disconnected";
  }
  updateControls();
});

client.on("hello", (hello) => {
  ui.model.textContent = hello.model;
  showModels();
  const limits = hello.limits;
  ui.maxTokens.max = String(limits.max_tokens);
  if (!ui.maxTokens.dataset.touched) ui.maxTokens.value = String(limits.default_max_tokens);
  showSampling();
  showTools();
});

ui.retry.addEventListener("click", () => client.connect());

// ------------------------------------------------------------------ turns

/** The answer being streamed, if any. @type {Turn | null} */
let current = null;
/** The latest answer of this page's session: what Regenerate restarts. @type {Turn | null} */
let last = null;
/**
 * What rendering costs per frame (script and the layout that scrolling
 * forces), for the benchmark and the console: a few numbers, never a log.
 */
const renderStats = {
  frames: 0,
  totalMs: 0,
  worstMs: 0,
  /** @param {number} ms */
  record(ms) {
    this.frames += 1;
    this.totalMs += ms;
    if (ms > this.worstMs) this.worstMs = ms;
  },
  reset() {
    this.frames = 0;
    this.totalMs = 0;
    this.worstMs = 0;
  },
};
/** What each answer's Copy button copies. @type {WeakMap<HTMLElement, () => string>} */
const answerText = new WeakMap();

/** One assistant answer: renders exactly one stream into one article. */
class Turn {
  /**
   * @param {GenerationStream} stream
   * @param {HTMLElement} article
   * @param {import("/store.js").StoredMessage} record where the answer is kept
   * @param {ChatMessage[]} messages the request's input
   * @param {Received} [prefix] what was already received (an answer resumed after a reload)
   */
  constructor(stream, article, record, messages, prefix = { text: "", reasoning: "" }) {
    this.stream = stream;
    this.article = article;
    this.record = record;
    this.messages = messages;
    this.view = new View(/** @type {HTMLElement} */ (article.querySelector(".text")));
    this.metaEl = /** @type {HTMLElement} */ (article.querySelector(".meta"));
    /** False once the turn may write no more text (stopped, replaced, ended). */
    this.open = true;
    this.sentAt = performance.now();
    /** @type {number | null} */
    this.firstAt = null;
    /** Characters of the answer taken from the stream (not its reasoning). */
    this.chars = 0;
    this.reasoningChars = 0;
    this.statsAt = 0;
    /** The "Thinking" block, once reasoning arrived. @type {HTMLDetailsElement | null} */
    this.thinking = null;
    /** @type {MarkdownView | PlainView | null} */
    this.thinkingView = null;

    record.content = prefix.text;
    record.meta = "";
    delete record.reasoning;
    delete record.tool_calls;
    this.metaEl.textContent = "";
    // A regenerate reuses the article: the old answer's reasoning and calls go.
    article.querySelector("details.thinking")?.remove();
    showToolCalls(article, [], false);
    if (prefix.text) this.view.append(prefix.text);
    /** Characters of the answer that came before this stream (a resume). */
    this.prefixChars = prefix.text.length;
    /** The reasoning that came before this stream (a resume). */
    this.prefixReasoning = prefix.reasoning;
    if (prefix.reasoning) this.showReasoning(prefix.reasoning);
    if (stream.toolCalls.length > 0) this.showCalls(false);
    answerText.set(article, () => this.view.source);
    article.querySelector(".notice")?.remove();
    article.classList.add("streaming");
    article.setAttribute("aria-busy", "true");

    stream.on("queued", ({ position, download }) => {
      if (current !== this) return;
      // A model from the Hub is downloaded before it loads (docs/models.md).
      if (download) setState("queued", `Getting the model — ${describeProgress(download)}`);
      else setState("queued", `Queued — position ${position}`);
    });
    stream.on("started", () => {
      if (current !== this) return;
      setState("streaming", "Generating…");
    });
    stream.on("resumed", () => {
      if (current !== this) return;
      setState("streaming", "Generating…");
    });
    stream.on("reasoning", (text) => this.receiveReasoning(text));
    stream.on("toolCall", () => {
      if (!this.open) return;
      this.endThinking();
      this.showCalls(false);
    });
    this.pump();
  }

  /** The text shown (and kept as the assistant's message). */
  get text() {
    return this.view.source;
  }

  async pump() {
    try {
      for await (const text of this.stream) this.receive(text);
      this.end(await this.stream.done);
    } catch (error) {
      this.fail(/** @type {Error} */ (error));
    }
  }

  /** @param {string} text */
  receive(text) {
    if (!this.open) return;
    if (this.firstAt === null) this.firstAt = performance.now();
    this.endThinking();
    this.view.append(text);
    this.chars += text.length;
    requestFrame();
  }

  /** @param {string} text the model's reasoning */
  receiveReasoning(text) {
    if (!this.open) return;
    if (this.firstAt === null) this.firstAt = performance.now();
    this.reasoningChars += text.length;
    this.showReasoning(text);
    requestFrame();
  }

  /**
   * Append reasoning to the "Thinking" block (made, collapsed, on first use).
   * @param {string} text
   */
  showReasoning(text) {
    if (this.thinking === null || this.thinkingView === null) {
      const { details, body } = thinkingBlock(this.article);
      this.thinking = details;
      this.thinkingView = new View(body);
    }
    setThinking(this.thinking, true);
    this.thinkingView.append(text);
  }

  /** The answer (or a call) began: the reasoning is complete. */
  endThinking() {
    if (this.thinking === null || this.thinking.dataset.state === "done") return;
    setThinking(this.thinking, false);
    this.thinkingView?.finish();
    this.record.reasoning = this.thinkingView?.source;
  }

  /**
   * Show the stream's tool calls as cards; mark unparsable arguments once complete.
   * @param {boolean} complete
   */
  showCalls(complete) {
    const calls = this.stream.toolCalls.map(({ index, id, name, arguments: args }) => ({ index, id, name, arguments: args }));
    if (calls.length === 0) return;
    keepAtBottom(() => showToolCalls(this.article, calls, complete));
    this.record.tool_calls = calls;
    store.touch();
  }

  /** Render what arrived since the last frame; keep the view at the bottom. */
  frame() {
    const start = performance.now();
    keepAtBottom(() => {
      this.thinkingView?.render();
      this.view.render();
    });
    renderStats.record(performance.now() - start);
    this.record.content = this.view.source;
    if (this.thinkingView !== null) this.record.reasoning = this.thinkingView.source;
    store.touch();
  }

  /** Show live statistics; at most every STATS_INTERVAL_MS unless forced. */
  showLiveStats(force = false) {
    const now = performance.now();
    if (!force && now - this.statsAt < STATS_INTERVAL_MS) return;
    this.statsAt = now;
    if (this.firstAt === null) {
      showStats("…", "–", "–");
      return;
    }
    const seconds = (now - this.firstAt) / 1000;
    const estimate = (this.chars + this.reasoningChars) / charsPerToken;
    const rate = seconds > 0.05 ? `≈${(estimate / seconds).toFixed(0)}` : "…";
    showStats(formatMs(this.firstAt - this.sentAt), rate, `≈${Math.round(estimate)}`);
  }

  /** No more text for this answer: render what arrived before, for good. */
  close() {
    if (!this.open) return;
    // Text the stream received before a Stop but this loop had not taken yet
    // belongs to the answer too.
    const untaken = this.stream.text.slice(this.chars);
    if (untaken) {
      this.view.append(untaken);
      this.chars += untaken.length;
    }
    keepAtBottom(() => this.view.finish());
    this.endThinking();
    this.showCalls(true);
    this.open = false;
    this.article.classList.remove("streaming");
    this.article.removeAttribute("aria-busy");
    this.record.content = this.view.source;
    store.touch(true);
  }

  /** @param {string} text */
  setMeta(text) {
    this.metaEl.textContent = text;
    this.record.meta = text;
    store.touch(true);
  }

  /** Stop: cancel in-band; the UI is idle at once, the `done` follows. */
  stop() {
    this.stream.cancel();
    this.close();
    this.setMeta("Stopped");
    if (current === this) {
      current = null;
      setState("idle", "Stopped");
    }
  }

  /** @param {DoneFrame} done */
  end(done) {
    this.close();
    if (this.stream.abandoned && last !== this) return; // replaced by a regenerate
    const { usage, timings } = done;
    const chars = this.text.length + (this.thinkingView?.source.length ?? 0);
    if (usage.completion_tokens >= 8 && chars > 0) charsPerToken = chars / usage.completion_tokens;
    const ttft = this.firstAt === null ? null : this.firstAt - this.sentAt;
    const parts = [
      `${usage.completion_tokens} tokens`,
      `${timings.tokens_per_s.toFixed(1)} tok/s`,
      `TTFT ${ttft === null ? "–" : formatMs(ttft)}`,
      REASONS[done.reason] ?? done.reason,
    ];
    this.setMeta(parts.join(" · "));
    if (current === this) {
      current = null;
      setState("idle", "Idle");
    }
    if (last === this) {
      showStats(ttft === null ? "–" : formatMs(ttft), timings.tokens_per_s.toFixed(1), String(usage.completion_tokens));
    }
  }

  /** @param {Error & {code?: string}} error */
  fail(error) {
    this.close();
    // A stopped or replaced answer already says so; its lost `done` changes nothing.
    if (this.stream.abandoned) return;
    const notice = document.createElement("p");
    notice.className = "notice";
    notice.setAttribute("role", "alert");
    notice.textContent =
      error.code === "unsupported_option"
        ? /'tools'|'tool_choice'/.test(error.message)
          ? `The server refused the tools: ${error.message}. Change them under Tools, or empty it.`
          : `The server refused an option: ${error.message}. Change it under Sampling, or Reset it.`
        : error.code === "connection_lost"
        ? "The connection dropped; this answer is incomplete."
        : error.code === "unknown_id"
          ? "The answer could not be picked up again; it is incomplete."
          : `The request failed: ${error.message}`;
    this.article.append(notice);
    this.setMeta("Incomplete");
    if (current === this) {
      current = null;
      setState("idle", "Idle");
    }
  }
}

/**
 * Run `change`; if the conversation was scrolled to the bottom, keep it there.
 * @param {() => void} change
 */
function keepAtBottom(change) {
  const view = ui.conversation;
  const stick = view.scrollHeight - view.scrollTop - view.clientHeight < STICK_PX;
  change();
  if (stick) view.scrollTop = view.scrollHeight;
}

const REASONS = /** @type {Record<string, string>} */ ({
  stop: "finished",
  tool_calls: "tool calls",
  length: "max tokens reached",
  cancelled: "stopped",
  error: "error",
});

// ------------------------------------------------------------------ frames

let frameRequested = false;

function requestFrame() {
  if (frameRequested) return;
  frameRequested = true;
  requestAnimationFrame(onFrame);
}

function onFrame() {
  frameRequested = false;
  if (current === null) return;
  current.frame();
  current.showLiveStats();
  // Keep the live numbers moving while the model is between tokens.
  if (current.open && current.firstAt !== null) requestFrame();
}

// ------------------------------------------------------------------ actions

/** The conversation being shown, created on first use. */
function conversation() {
  return store.current ?? store.create();
}

function send() {
  const content = ui.prompt.value;
  if ((!content.trim() && attachments.size === 0) || attachments.reading > 0 || !canSend()) return;
  if (attachments.size > 0 && attachments.refusal) return; // the model reads no images: said under the composer
  const chat = conversation();
  if (editing !== null) {
    // Edit and resend: the edited message replaces the old one and its answer.
    chat.messages.splice(editing);
    stopEditing();
    last = null;
    showConversation();
  }
  ui.prompt.value = "";
  const images = attachments.take();
  chat.messages.push(images.length ? { role: "user", content, images } : { role: "user", content });
  const messages = fitHistory(chat.messages);
  const record = /** @type {import("/store.js").StoredMessage} */ ({ role: "assistant", content: "" });
  chat.messages.push(record);
  store.touch(true);
  showImages(appendMessage("user", content), images);
  const article = appendMessage("assistant", "");
  markLastUser();
  showHistory();
  begin(client.generate({ messages, ...options() }), article, record, messages);
}

function regenerate() {
  if (client.state !== "open") return;
  if (last !== null) {
    // Restart by ID: the server drops the old request, the client its late text.
    const previous = last;
    const chosen = options();
    // A restart inherits every field of the old request that it does not
    // override, and cannot take one away (a JSON schema switched off since):
    // then the old request is cancelled and the history asked again.
    const inherited = Object.keys(previous.stream.input).filter((key) => SAMPLED.has(key) && !(key in chosen));
    if (inherited.length === 0) {
      const stream = client.restart(previous.stream, chosen);
      previous.open = false; // its late text, if any, must not land in the new answer
      begin(stream, previous.article, previous.record, previous.messages);
      return;
    }
    previous.stream.cancel();
    previous.open = false;
    setState("waiting", "Waiting for the model…");
    previous.stream
      .result()
      .catch(() => undefined)
      .then(() => {
        if (client.state !== "open" || last !== previous) return;
        begin(client.generate({ messages: previous.messages, ...chosen }), previous.article, previous.record, previous.messages);
      });
    return;
  }
  // An answer from before a reload: ask again with the same history.
  const chat = store.current;
  const record = chat?.messages.at(-1);
  const article = /** @type {HTMLElement | null} */ (ui.log.querySelector(".message.assistant:last-of-type"));
  if (!chat || record?.role !== "assistant" || article === null) return;
  const messages = fitHistory(chat.messages.slice(0, -1));
  begin(client.generate({ messages, ...options() }), article, record, messages);
}

function stop() {
  current?.stop();
}

function newChat() {
  current?.stop();
  stopEditing();
  const picked = chosenModel();
  const fresh = store.create();
  if (picked !== undefined) fresh.model = picked;
  showConversation();
  showHistory();
  ui.prompt.focus();
}

/** @param {string} id */
function openConversation(id) {
  current?.stop();
  stopEditing();
  store.select(id);
  showConversation();
  showHistory();
}

/** Edit the last user message: it goes back into the composer. */
function editLast() {
  const chat = store.current;
  if (!chat) return;
  const index = chat.messages.findLastIndex((m) => m.role === "user");
  if (index < 0) return;
  current?.stop();
  editing = index;
  ui.prompt.value = chat.messages[index].content;
  // Its images come back to the composer too (removable there).
  attachments.images = [...(chat.messages[index].images ?? [])];
  attachments.render();
  ui.app.dataset.editing = "true";
  ui.editing.hidden = false;
  ui.prompt.focus();
  updateControls();
}

function stopEditing() {
  editing = null;
  delete ui.app.dataset.editing;
  ui.editing.hidden = true;
}

/**
 * @param {GenerationStream} stream
 * @param {HTMLElement} article
 * @param {import("/store.js").StoredMessage} record
 * @param {ChatMessage[]} messages
 * @param {Received} [prefix]
 */
function begin(stream, article, record, messages, prefix) {
  const turn = new Turn(stream, article, record, messages, prefix);
  current = turn;
  last = turn;
  showStats("…", "–", "–");
  setState("waiting", "Waiting for the model…");
  turn.showLiveStats(true);
  ui.conversation.scrollTop = ui.conversation.scrollHeight;
}

/**
 * The request's `messages`: the conversation, without its oldest messages if
 * it exceeds the server's limits (`hello.limits`: messages, characters), so
 * that a long conversation goes on instead of being refused. The newest
 * message is always sent.
 * @param {import("/store.js").StoredMessage[]} history
 */
function fitHistory(history) {
  const limits = client.hello?.limits;
  const maxMessages = limits?.max_messages ?? Infinity;
  const maxChars = limits?.max_prompt_chars ?? Infinity;
  let chars = 0;
  let start = history.length;
  while (start > 0) {
    const next = chars + messageChars(history[start - 1]);
    if (start < history.length && (next > maxChars || history.length - start + 1 > maxMessages)) break;
    chars = next;
    start -= 1;
  }
  // A chat template wants the history to begin with the user.
  while (start < history.length - 1 && history[start].role !== "user") start += 1;
  return history.slice(start).map(historyMessage);
}

/**
 * What a message counts against `max_prompt_chars`: its text, and its calls'
 * names and arguments (the server counts them too).
 * @param {import("/store.js").StoredMessage} message
 */
function messageChars(message) {
  return storedCalls(message.tool_calls).reduce((n, c) => n + c.name.length + c.arguments.length, message.content.length);
}

/**
 * A stored message as the request sends it: an answer with tool calls
 * carries them (its text, `null` if it has none), its reasoning stays out.
 * @param {import("/store.js").StoredMessage} message
 * @returns {ChatMessage}
 */
function historyMessage({ role, content, tool_calls, images }) {
  const calls = storedCalls(tool_calls);
  // A user message's images go again every turn (the model reads the whole
  // conversation); the client uploads their bytes in binary frames.
  if (role === "user" && images?.length) return { role, content, images: images.map(dataUrlBytes) };
  if (role !== "assistant" || calls.length === 0) return { role, content };
  return {
    role,
    content: content || null,
    tool_calls: calls.map((c) => ({ id: c.id, type: "function", function: { name: c.name, arguments: c.arguments } })),
  };
}

/** The fields of a request that the sampling and tools disclosures decide. */
const SAMPLED = new Set(["temperature", "repeat_penalty", "repeat_last_n", "min_p", "json_schema", "tools"]);

/** The request's options from the controls; invalid or empty fields are left out. */
function options() {
  const limit = Number(ui.maxTokens.max) || Infinity;
  const maxTokens = Number.parseInt(ui.maxTokens.value, 10);
  const seed = Number.parseInt(ui.seed.value, 10);
  /** @type {Record<string, unknown>} */
  const chosen = {
    ...requestOptions(settings, client.hello?.honours),
    seed: seed >= 0 && seed < 2 ** 32 ? seed : undefined,
    model: chosenModel(),
  };
  if (maxTokens >= 1) chosen.max_tokens = Math.min(maxTokens, limit);
  if (toolsSetting.tools !== null) chosen.tools = toolsSetting.tools;
  return chosen;
}

// ------------------------------------------------------------------ tools

/** Take the tools' text: kept as typed, sent only while it is a valid list. */
function readTools() {
  saveTools(ui.toolsText.value);
  toolsSetting = parseTools(ui.toolsText.value);
  showTools();
}

/** The summary (the functions' names) and the note: invalid, or not honoured. */
function showTools() {
  const { tools, error } = toolsSetting;
  if (error !== null) ui.toolsText.setAttribute("aria-invalid", "true");
  else ui.toolsText.removeAttribute("aria-invalid");
  ui.toolsSummary.textContent = tools ? tools.map((t) => t.function.name).join(", ") : error ? "invalid" : "none";
  const honours = client.hello?.honours;
  ui.toolsNote.classList.toggle("invalid", error !== null);
  if (error !== null) {
    ui.toolsNote.textContent = `Not a list of function tools: ${error}. No tools are sent until it is fixed.`;
  } else if (tools && Array.isArray(honours) && !honours.includes("tools")) {
    ui.toolsNote.textContent = "This server's engine does not take tools: a request with them is refused.";
  } else {
    ui.toolsNote.textContent = "";
  }
}

// ------------------------------------------------------------------ sampling

const SAMPLING_FIELDS = /** @type {const} */ ([
  ["temperature", "temperature", "Temperature"],
  ["repeatPenalty", "repeat_penalty", "Repeat penalty"],
  ["repeatLastN", "repeat_last_n", "Penalty window"],
  ["minP", "min_p", "min_p"],
]);

/** Put the settings into the disclosure's fields. */
function fillSampling() {
  for (const [field, name] of SAMPLING_FIELDS) {
    ui[field].value = String(settings[name]);
    ui[field].removeAttribute("aria-invalid");
  }
  ui.json.checked = settings.json;
  ui.temperatureValue.value = settings.temperature.toFixed(2);
  showSampling();
}

/** Take a field's value if it is valid; say what is wrong if not. */
function readSampling() {
  const problems = [];
  for (const [field, name, label] of SAMPLING_FIELDS) {
    const value = valid(name, ui[field].value);
    if (value === null) {
      ui[field].setAttribute("aria-invalid", "true");
      const range = RANGES[name];
      const kind = range.integer ? "a whole number" : "a number";
      problems.push(`${label} must be ${kind} from ${range.min} to ${range.max}`);
    } else {
      ui[field].removeAttribute("aria-invalid");
      settings[name] = value;
    }
  }
  settings.json = ui.json.checked;
  ui.temperatureValue.value = settings.temperature.toFixed(2);
  saveSettings(settings);
  showSampling(problems);
}

/**
 * The summary line (values at a glance) and the note: invalid values (the
 * last valid one is used), or what this server's engine does not honour.
 * @param {string[]} [problems]
 */
function showSampling(problems = []) {
  const parts = [`temperature ${settings.temperature.toFixed(2)}`];
  parts.push(`repeat ${settings.repeat_penalty}/${settings.repeat_last_n}`, `min_p ${settings.min_p}`);
  if (settings.json) parts.push("JSON");
  ui.samplingSummary.textContent = parts.join(" · ");
  const names = /** @type {Record<string, string>} */ ({
    repeat_penalty: "repeat penalty",
    min_p: "min_p",
    json_schema: "JSON",
  });
  const declined = unhonoured(client.hello?.honours).map((name) => names[name]);
  ui.samplingNote.classList.toggle("invalid", problems.length > 0);
  if (problems.length > 0) {
    ui.samplingNote.textContent = `${problems.join("; ")}: the last valid value is used.`;
  } else if (declined.length > 0) {
    ui.samplingNote.textContent =
      `This server's engine does not honour ${declined.join(", ")}: the defaults are left out, ` +
      "another value is refused.";
  } else {
    ui.samplingNote.textContent = "";
  }
}

// ------------------------------------------------------------------ the log

// ------------------------------------------------------------------ models

/**
 * The current conversation's model, if it picked one the server still serves
 * (undefined: the server's default).
 * @returns {string | undefined}
 */
function chosenModel() {
  const picked = store.current?.model;
  const served = servedModels().some((m) => m.name === picked);
  return picked !== undefined && served ? picked : undefined;
}

/**
 * Models pulled from this page since its connection's hello (a new
 * connection's hello lists them itself).
 * @type {import("/wsserver.js").ModelInfo[]}
 */
const pulledModels = [];

/** The server's models: its hello's, and any pulled since. */
function servedModels() {
  const listed = client.hello?.models ?? [];
  const names = new Set(listed.map((m) => m.name));
  return [...listed, ...pulledModels.filter((m) => !names.has(m.name))];
}

/** The picker: the server's models, the current conversation's selected. */
function showModels() {
  const hello = client.hello;
  const models = servedModels();
  pulls.update();
  ui.modelPicker.hidden = models.length < 2;
  ui.model.hidden = !ui.modelPicker.hidden;
  showImageControls();
  if (models.length < 2 || !hello) return;
  ui.modelPicker.replaceChildren(
    ...models.map((m) => {
      const option = document.createElement("option");
      option.value = m.name;
      option.textContent = m.state === "loaded" ? m.name : `${m.name} (${m.state})`;
      return option;
    }),
  );
  ui.modelPicker.value = chosenModel() ?? hello.model;
}

ui.modelPicker.addEventListener("change", () => {
  conversation().model = ui.modelPicker.value;
  store.saveNow(); // kept with it, without moving it up the history
  pulls.update();
  showImageControls();
});

/**
 * Whether the current model reads images: what `hello` says of a loaded
 * model (`input_modalities`); undefined before it loads (not said).
 * @returns {boolean | undefined}
 */
function readsImages() {
  const name = chosenModel() ?? client.hello?.model;
  const modalities = servedModels().find((m) => m.name === name)?.input_modalities;
  return modalities ? modalities.includes("image") : undefined;
}

/** The Image button for a model that reads images; a refusal for one that does not. */
function showImageControls() {
  const reads = readsImages();
  ui.attach.hidden = reads === false;
  const name = chosenModel() ?? client.hello?.model ?? "This model";
  attachments.refuse(reads === false ? `${name} does not read images: pick a model that does` : "");
}

/** The base-model notice and the "Get a model" dialog (pulls.js). */
const pulls = setupPulls({
  client,
  currentModel: () => chosenModel() ?? client.hello?.model ?? "",
  onPulled: (model) => {
    pulledModels.push(model);
    conversation().model = model.name; // talk to it from now on
    store.saveNow();
    showModels();
  },
});

/** Show the current conversation from the store (on load, switch, edit). */
function showConversation() {
  current = null;
  showModels();
  last = null;
  ui.log.replaceChildren(ui.empty);
  const chat = store.current;
  for (const message of chat?.messages ?? []) {
    const article = appendMessage(message.role, message.content);
    if (message.role === "user") showImages(article, message.images);
    if (message.role === "assistant") {
      const view = new View(/** @type {HTMLElement} */ (article.querySelector(".text")));
      view.append(message.content);
      view.finish();
      answerText.set(article, () => view.source);
      if (typeof message.reasoning === "string" && message.reasoning) {
        const { details, body } = thinkingBlock(article);
        const thoughts = new View(body);
        thoughts.append(message.reasoning);
        thoughts.finish();
        setThinking(details, false);
      }
      showToolCalls(article, storedCalls(message.tool_calls), true);
      /** @type {HTMLElement} */ (article.querySelector(".meta")).textContent = message.meta || "Incomplete";
    }
  }
  ui.empty.hidden = (chat?.messages.length ?? 0) > 0;
  markLastUser();
  showStats("–", "–", "–");
  setState("idle", "Idle");
  ui.conversation.scrollTop = ui.conversation.scrollHeight;
}

/**
 * @param {"user" | "assistant"} role
 * @param {string} text
 */
function appendMessage(role, text) {
  ui.empty.hidden = true;
  return appendTo(ui.log, role, text);
}

const markLastUser = () => markLastUserIn(ui.log);
const showHistory = () => showHistoryIn(ui.history, store.conversations, store.currentId);

// ------------------------------------------------------------------ state

/**
 * @param {"idle" | "waiting" | "queued" | "streaming"} state
 * @param {string} activity
 */
function setState(state, activity) {
  ui.app.dataset.state = state;
  ui.activity.textContent = activity;
  updateControls();
}

function canSend() {
  return ui.app.dataset.state === "idle" && client.state === "open";
}

function updateControls() {
  const busy = ui.app.dataset.state !== "idle";
  const hadFocus = document.activeElement;
  ui.send.disabled =
    !canSend() ||
    (!ui.prompt.value.trim() && attachments.size === 0) ||
    attachments.reading > 0 ||
    (attachments.size > 0 && attachments.refusal !== "");
  ui.send.textContent = editing === null ? "Send" : "Resend";
  ui.stop.disabled = !busy;
  const lastMessage = store.current?.messages.at(-1);
  ui.regenerate.disabled = client.state !== "open" || (last === null && lastMessage?.role !== "assistant");
  // A button that disables itself under the keyboard focus would drop the
  // focus to <body>; hand it to the prompt instead.
  if (hadFocus instanceof HTMLButtonElement && hadFocus.disabled) ui.prompt.focus();
}

/**
 * @param {string} ttft
 * @param {string} rate
 * @param {string} tokens
 */
function showStats(ttft, rate, tokens) {
  if (ui.ttft.textContent !== ttft) ui.ttft.textContent = ttft;
  if (ui.rate.textContent !== rate) ui.rate.textContent = rate;
  if (ui.tokens.textContent !== tokens) ui.tokens.textContent = tokens;
}

/** @param {number} ms */
function formatMs(ms) {
  return ms < 1000 ? `${Math.round(ms)} ms` : `${(ms / 1000).toFixed(2)} s`;
}

// ------------------------------------------------------------------ wiring

ui.composer.addEventListener("submit", (event) => {
  event.preventDefault();
  send();
});

ui.prompt.addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    send();
  }
});

ui.prompt.addEventListener("input", updateControls);
ui.attach.addEventListener("click", () => ui.imageInput.click());
ui.imageInput.addEventListener("change", () => {
  const files = Array.from(ui.imageInput.files ?? []);
  ui.imageInput.value = ""; // picking the same file again is a change too
  void attachments.add(files);
});
ui.prompt.addEventListener("paste", (event) => {
  const files = imageFiles(event.clipboardData);
  if (files.length === 0) return; // text: pasted as always
  event.preventDefault();
  void attachments.add(files);
});
ui.composer.addEventListener("dragover", (event) => {
  if (!event.dataTransfer?.types.includes("Files")) return;
  event.preventDefault();
  ui.composer.classList.add("dropping");
});
ui.composer.addEventListener("dragleave", () => ui.composer.classList.remove("dropping"));
ui.composer.addEventListener("drop", (event) => {
  ui.composer.classList.remove("dropping");
  const files = imageFiles(event.dataTransfer);
  if (files.length === 0) return;
  event.preventDefault();
  void attachments.add(files);
});
ui.stop.addEventListener("click", stop);
ui.regenerate.addEventListener("click", regenerate);
ui.newChat.addEventListener("click", newChat);
ui.cancelEdit.addEventListener("click", () => {
  stopEditing();
  ui.prompt.value = "";
  attachments.take(); // the edited message's images, put back by editLast
  updateControls();
});

ui.log.addEventListener("click", (event) => {
  const button = /** @type {HTMLElement} */ (event.target).closest("button");
  if (button === null) return;
  if (button.classList.contains("copy")) {
    const code = button.closest("figure")?.querySelector("code");
    copy(code?.textContent ?? "", button);
  } else if (button.classList.contains("copy-answer")) {
    const article = /** @type {HTMLElement} */ (button.closest("article"));
    copy(answerText.get(article)?.() ?? "", button);
  } else if (button.classList.contains("edit")) {
    editLast();
  }
});

ui.history.addEventListener("click", (event) => {
  const button = /** @type {HTMLElement} */ (event.target).closest("button");
  const id = button?.closest("li")?.dataset.id;
  if (!button || !id) return;
  if (button.classList.contains("delete-chat")) {
    if (id === store.currentId) current?.stop();
    store.remove(id);
    if (store.current === null) store.create();
    showConversation();
    showHistory();
  } else if (id !== store.currentId) {
    openConversation(id);
  }
});

document.addEventListener("keydown", (event) => {
  if (event.key !== "Escape") return;
  if (current) {
    event.preventDefault();
    stop();
  } else if (editing !== null) {
    event.preventDefault();
    ui.cancelEdit.click();
  }
});

for (const [field] of SAMPLING_FIELDS) ui[field].addEventListener("input", readSampling);
ui.json.addEventListener("change", readSampling);
ui.toolsText.addEventListener("input", readTools);
ui.samplingReset.addEventListener("click", () => {
  Object.assign(settings, DEFAULTS);
  saveSettings(settings);
  fillSampling();
});

ui.maxTokens.addEventListener("input", () => {
  ui.maxTokens.dataset.touched = "1";
});

// A reload mid-answer keeps what had been shown, and the answer goes on: save
// it on the way out, with what resuming it needs.
addEventListener("pagehide", () => {
  saveResumable();
  store.saveNow();
});

/** Keep the streaming answer's id, token and last seq for the next page. */
function saveResumable() {
  const stream = current?.stream;
  if (!current || !stream || !stream.resumable || stream.abandoned || !store.currentId) return;
  const saved = {
    id: stream.id,
    resumeToken: stream.resumeToken,
    afterSeq: stream.lastSeq,
    // Exactly the text up to afterSeq (the store may hold a little less).
    text: current.text.slice(0, current.prefixChars) + stream.text,
    reasoning: current.prefixReasoning + stream.reasoning,
    // The calls so far (a resumed stream's include those it was given).
    toolCalls: stream.toolCalls.map(({ index, id, name, arguments: args }) => ({ index, id, name, arguments: args })),
    conversation: store.currentId,
  };
  try {
    sessionStorage.setItem(RESUME_KEY, JSON.stringify(saved));
  } catch {
    // Storage full or disabled: the answer stays as shown, incomplete.
  }
}

/** After a reload: pick the answer that was streaming up where it was. */
function resumeSaved() {
  let saved;
  try {
    saved = JSON.parse(sessionStorage.getItem(RESUME_KEY) ?? "null");
    sessionStorage.removeItem(RESUME_KEY);
  } catch {
    return;
  }
  if (!saved || typeof saved.id !== "string" || typeof saved.resumeToken !== "string") return;
  const chat = store.current;
  const record = chat?.messages.at(-1);
  const article = /** @type {HTMLElement | null} */ (ui.log.querySelector(".message.assistant:last-of-type"));
  if (!chat || store.currentId !== saved.conversation || record?.role !== "assistant" || article === null) return;
  const stream = client.resume({
    id: saved.id,
    resumeToken: saved.resumeToken,
    afterSeq: saved.afterSeq,
    toolCalls: storedCalls(saved.toolCalls),
  });
  const prefix = { text: String(saved.text ?? ""), reasoning: String(saved.reasoning ?? "") };
  begin(stream, article, record, fitHistory(chat.messages.slice(0, -1)), prefix);
}

fillSampling();
ui.toolsText.value = loadTools();
showTools();
showConversation();
showHistory();
resumeSaved();
ui.prompt.focus();

// For the browser console and the tests: the client, the streams, the store.
Object.defineProperty(window, "chat", {
  value: Object.freeze({
    client,
    store,
    renderStats,
    /** The stream being rendered, if any. */
    current: () => current?.stream ?? null,
    /** The latest answer's stream. */
    last: () => last?.stream ?? null,
  }),
});
