/**
 * The wsserver chat page.
 *
 * Rendering is decoupled from the network: text that arrives between two
 * animation frames is buffered and appended to the answer once per frame, as
 * one new text node. The answer is never re-rendered as a whole, and it is
 * laid out in blocks so that a long answer does not make each frame dearer:
 * the cost of a frame grows neither with the token rate nor with the length of
 * the answer, and typing and clicking stay responsive however fast the model
 * streams.
 *
 * Stop cancels in-band and returns the UI to idle at once; the server's
 * `done` frame (with its timings) fills in the statistics when it arrives.
 * Regenerate restarts the last request; the JS client drops any late text of
 * the old request, and each answer's renderer only ever writes its own stream.
 */

import { WsClient } from "/wsserver.js";

/** @typedef {import("/wsserver.js").GenerationStream} GenerationStream */
/** @typedef {import("/wsserver.js").DoneFrame} DoneFrame */

const $ = (/** @type {string} */ id) => /** @type {HTMLElement} */ (document.getElementById(id));

const ui = {
  app: $("app"),
  model: $("model"),
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
  send: /** @type {HTMLButtonElement} */ ($("send")),
  stop: /** @type {HTMLButtonElement} */ ($("stop")),
  regenerate: /** @type {HTMLButtonElement} */ ($("regenerate")),
  newChat: /** @type {HTMLButtonElement} */ ($("new-chat")),
};

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
/**
 * An answer is laid out as a column of blocks of about this many characters.
 * Appending to one ever-growing paragraph makes the browser re-break every
 * line of it on each frame — hundreds of milliseconds once an answer is long
 * — while a new block leaves the finished ones' layout cached. A block ends
 * at a line break where possible, so the split is invisible.
 */
const BLOCK_CHARS = 2000;
/** Without a line break, a block is cut at a space after this many characters. */
const BLOCK_CHARS_MAX = 6000;

// ------------------------------------------------------------------ connection

const client = new WsClient(`${location.protocol === "https:" ? "wss" : "ws"}://${location.host}/`, {
  token: takeToken(),
});

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
  const limits = hello.limits;
  ui.maxTokens.max = String(limits.max_tokens);
  if (!ui.maxTokens.dataset.touched) ui.maxTokens.value = String(limits.default_max_tokens);
});

ui.retry.addEventListener("click", () => client.connect());

// ------------------------------------------------------------------ turns

/** The answer being streamed, if any. @type {Turn | null} */
let current = null;
/** The latest answer (streaming or finished): what Regenerate restarts. @type {Turn | null} */
let last = null;

/** One assistant answer: renders exactly one stream into one article. */
class Turn {
  /**
   * @param {GenerationStream} stream
   * @param {HTMLElement} article
   * @param {{role: string, content: string}[]} messages the request's input
   */
  constructor(stream, article, messages) {
    this.stream = stream;
    this.article = article;
    this.messages = messages;
    this.textEl = /** @type {HTMLElement} */ (article.querySelector(".text"));
    /** The block text is appended to. @type {HTMLElement | null} */
    this.block = null;
    this.blockChars = 0;
    this.metaEl = /** @type {HTMLElement} */ (article.querySelector(".meta"));
    /** Text received since the last animation frame. */
    this.pending = "";
    /** False once the turn may write no more text (stopped, replaced, ended). */
    this.open = true;
    this.sentAt = performance.now();
    /** @type {number | null} */
    this.firstAt = null;
    this.chars = 0;
    this.statsAt = 0;

    this.textEl.replaceChildren();
    this.block = null;
    this.metaEl.textContent = "";
    article.querySelector(".notice")?.remove();
    article.classList.add("streaming");
    article.setAttribute("aria-busy", "true");

    stream.on("queued", ({ position }) => {
      if (current !== this) return;
      setState("queued", `Queued — position ${position}`);
    });
    stream.on("started", () => {
      if (current !== this) return;
      setState("streaming", "Generating…");
    });
    this.pump();
  }

  /** The text shown (and kept as the assistant's message). */
  get text() {
    return this.stream.text;
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
    this.pending += text;
    this.chars += text.length;
    requestFrame();
  }

  /** Append the text buffered since the last frame: one text node, no re-render. */
  flush() {
    if (!this.pending) return;
    const view = ui.conversation;
    const stick = view.scrollHeight - view.scrollTop - view.clientHeight < STICK_PX;
    let text = this.pending;
    this.pending = "";
    if (this.blockChars >= BLOCK_CHARS) {
      let cut = text.lastIndexOf("\n") + 1;
      if (cut === 0 && this.blockChars >= BLOCK_CHARS_MAX) cut = text.lastIndexOf(" ") + 1 || text.length;
      if (cut > 0) {
        this.appendToBlock(text.slice(0, cut));
        text = text.slice(cut);
        this.block = null;
      }
    }
    if (text) this.appendToBlock(text);
    if (stick) view.scrollTop = view.scrollHeight;
  }

  /** @param {string} text */
  appendToBlock(text) {
    if (this.block === null) {
      this.block = document.createElement("div");
      this.block.className = "block";
      this.blockChars = 0;
      this.textEl.append(this.block);
    }
    this.block.append(text);
    this.blockChars += text.length;
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
    const estimate = this.chars / charsPerToken;
    const rate = seconds > 0.05 ? `≈${(estimate / seconds).toFixed(0)}` : "…";
    showStats(formatMs(this.firstAt - this.sentAt), rate, `≈${Math.round(estimate)}`);
  }

  /** No more text for this answer: flush what arrived before, close the caret. */
  close() {
    if (!this.open) return;
    // Text the stream received before a Stop but this loop had not taken yet
    // belongs to the answer too.
    const untaken = this.stream.text.slice(this.chars);
    if (untaken) {
      this.pending += untaken;
      this.chars += untaken.length;
    }
    this.flush();
    this.open = false;
    this.article.classList.remove("streaming");
    this.article.removeAttribute("aria-busy");
  }

  /** Stop: cancel in-band; the UI is idle at once, the `done` follows. */
  stop() {
    this.stream.cancel();
    this.close();
    this.metaEl.textContent = "Stopped";
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
    if (usage.completion_tokens >= 8 && this.text.length > 0) {
      charsPerToken = this.text.length / usage.completion_tokens;
    }
    const ttft = this.firstAt === null ? null : this.firstAt - this.sentAt;
    const parts = [
      `${usage.completion_tokens} tokens`,
      `${timings.tokens_per_s.toFixed(1)} tok/s`,
      `TTFT ${ttft === null ? "–" : formatMs(ttft)}`,
      REASONS[done.reason] ?? done.reason,
    ];
    this.metaEl.textContent = parts.join(" · ");
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
      error.code === "connection_lost"
        ? "The connection dropped; this answer is incomplete."
        : `The request failed: ${error.message}`;
    this.article.append(notice);
    if (current === this) {
      current = null;
      setState("idle", "Idle");
    }
  }
}

const REASONS = /** @type {Record<string, string>} */ ({
  stop: "finished",
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
  current.flush();
  current.showLiveStats();
  // Keep the live numbers moving while the model is between tokens.
  if (current.open && current.firstAt !== null) requestFrame();
}

// ------------------------------------------------------------------ actions

function send() {
  const content = ui.prompt.value;
  if (!content.trim() || !canSend()) return;
  ui.prompt.value = "";
  const messages = last ? [...last.messages] : [];
  if (last && last.text) messages.push({ role: "assistant", content: last.text });
  messages.push({ role: "user", content });
  appendMessage("user", content);
  const article = appendMessage("assistant", "");
  begin(client.generate({ messages, ...options() }), article, messages);
}

function regenerate() {
  if (!last || client.state !== "open") return;
  const previous = last;
  const stream = client.restart(previous.stream, options());
  previous.open = false; // its late text, if any, must not land in the new answer
  previous.pending = "";
  begin(stream, previous.article, previous.messages);
}

function stop() {
  current?.stop();
}

function newChat() {
  current?.stop();
  current = null;
  last = null;
  ui.log.replaceChildren(ui.empty);
  ui.empty.hidden = false;
  showStats("–", "–", "–");
  setState("idle", "Idle");
  ui.prompt.focus();
}

/**
 * @param {GenerationStream} stream
 * @param {HTMLElement} article
 * @param {{role: string, content: string}[]} messages
 */
function begin(stream, article, messages) {
  const turn = new Turn(stream, article, messages);
  current = turn;
  last = turn;
  showStats("…", "–", "–");
  setState("waiting", "Waiting for the model…");
  turn.showLiveStats(true);
  ui.conversation.scrollTop = ui.conversation.scrollHeight;
}

/** The sampling options from the controls; invalid or empty fields are left out. */
function options() {
  const limit = Number(ui.maxTokens.max) || Infinity;
  const maxTokens = Number.parseInt(ui.maxTokens.value, 10);
  const temperature = Number.parseFloat(ui.temperature.value);
  const seed = Number.parseInt(ui.seed.value, 10);
  return {
    max_tokens: maxTokens >= 1 ? Math.min(maxTokens, limit) : undefined,
    temperature: Number.isFinite(temperature) ? temperature : undefined,
    seed: seed >= 0 && seed < 2 ** 32 ? seed : undefined,
  };
}

/**
 * @param {"user" | "assistant"} role
 * @param {string} text
 * @returns {HTMLElement}
 */
function appendMessage(role, text) {
  ui.empty.hidden = true;
  const article = document.createElement("article");
  article.className = `message ${role}`;
  const label = document.createElement("p");
  label.className = "role";
  label.textContent = role === "user" ? "You" : "Model";
  const body = document.createElement("div");
  body.className = "text";
  body.textContent = text;
  article.append(label, body);
  if (role === "assistant") {
    const meta = document.createElement("p");
    meta.className = "meta";
    article.append(meta);
  }
  ui.log.append(article);
  return article;
}

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
  ui.send.disabled = !canSend() || !ui.prompt.value.trim();
  ui.stop.disabled = !busy;
  ui.regenerate.disabled = !last || client.state !== "open";
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
ui.stop.addEventListener("click", stop);
ui.regenerate.addEventListener("click", regenerate);
ui.newChat.addEventListener("click", newChat);

document.addEventListener("keydown", (event) => {
  if (event.key === "Escape" && current) {
    event.preventDefault();
    stop();
  }
});

ui.temperature.addEventListener("input", () => {
  ui.temperatureValue.value = Number(ui.temperature.value).toFixed(2);
});

ui.maxTokens.addEventListener("input", () => {
  ui.maxTokens.dataset.touched = "1";
});

ui.temperatureValue.value = Number(ui.temperature.value).toFixed(2);
updateControls();
ui.prompt.focus();

// For the browser console and the tests: the client and the streams.
Object.defineProperty(window, "chat", {
  value: Object.freeze({
    client,
    /** The stream being rendered, if any. */
    current: () => current?.stream ?? null,
    /** The latest answer's stream. */
    last: () => last?.stream ?? null,
  }),
});
