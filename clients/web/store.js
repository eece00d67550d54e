/**
 * Conversations, kept in localStorage so that a reload (or a crash) loses
 * nothing that had been shown.
 *
 * One key holds everything, as JSON: `{version, currentId, conversations}`,
 * newest conversation first. Writes are throttled while an answer streams
 * (an answer of 100,000 characters is not re-serialised on every frame) and
 * immediate at the end of a turn. When the browser's quota (about 5 MB per
 * origin) is full, the oldest conversations are dropped, never the current
 * one.
 */

const KEY = "wsserver.chat.v1";
const VERSION = 1;
/** While streaming, save at most this often. */
const SAVE_INTERVAL_MS = 1000;

/**
 * @typedef {{role: "user" | "assistant", content: string, meta?: string, reasoning?: string, tool_calls?: import("/tools.js").StoredCall[], images?: string[]}} StoredMessage
 *   an answer's `reasoning` and `tool_calls` (tools.js) are kept beside its text; a
 *   user message's `images` as data URLs (attach.js: at most 2 MiB each)
 * @typedef {{id: string, title: string, updated: number, messages: StoredMessage[], model?: string}} Conversation
 * (``model``: the one picked for it; absent: the server's default)
 */

export class ConversationStore {
  constructor(storage = globalThis.localStorage) {
    this.storage = storage;
    /** @type {Conversation[]} */
    this.conversations = [];
    /** @type {string | null} */
    this.currentId = null;
    this.timer = 0;
    this.load();
  }

  load() {
    try {
      const data = JSON.parse(this.storage.getItem(KEY) ?? "null");
      if (data?.version === VERSION && Array.isArray(data.conversations)) {
        this.conversations = data.conversations.filter(isConversation);
        this.currentId = typeof data.currentId === "string" ? data.currentId : null;
      }
    } catch {
      // Unreadable (or no storage at all): start empty rather than fail the page.
    }
    if (this.current === null) this.currentId = this.conversations[0]?.id ?? null;
  }

  /** @returns {Conversation | null} */
  get current() {
    return this.conversations.find((c) => c.id === this.currentId) ?? null;
  }

  /** A new, empty conversation, made current (not stored until it has a message). */
  create() {
    const conversation = { id: newId(), title: "", updated: Date.now(), messages: [] };
    this.conversations.unshift(conversation);
    this.currentId = conversation.id;
    return conversation;
  }

  /** @param {string} id */
  select(id) {
    if (this.conversations.some((c) => c.id === id)) this.currentId = id;
    this.saveNow();
  }

  /** @param {string} id */
  remove(id) {
    this.conversations = this.conversations.filter((c) => c.id !== id);
    if (this.currentId === id) this.currentId = this.conversations[0]?.id ?? null;
    this.saveNow();
  }

  /** The current conversation changed: move it to the top, save soon. */
  touch(immediately = false) {
    const conversation = this.current;
    if (conversation !== null) {
      conversation.updated = Date.now();
      if (!conversation.title) {
        const first = conversation.messages.find((m) => m.role === "user");
        if (first) conversation.title = first.content.trim().replace(/\s+/g, " ").slice(0, 80);
      }
      if (this.conversations[0] !== conversation) {
        this.conversations = [conversation, ...this.conversations.filter((c) => c !== conversation)];
      }
    }
    if (immediately) this.saveNow();
    else if (!this.timer) this.timer = setTimeout(() => this.saveNow(), SAVE_INTERVAL_MS);
  }

  saveNow() {
    clearTimeout(this.timer);
    this.timer = 0;
    const kept = this.conversations.filter((c) => c.messages.length > 0);
    for (;;) {
      try {
        this.storage.setItem(KEY, JSON.stringify({ version: VERSION, currentId: this.currentId, conversations: kept }));
        return;
      } catch {
        // Over quota: drop the oldest conversation that is not the current one.
        const index = kept.findLastIndex((c) => c.id !== this.currentId);
        if (index < 0) return; // the current one alone does not fit: keep what was saved
        const [dropped] = kept.splice(index, 1);
        this.conversations = this.conversations.filter((c) => c !== dropped);
      }
    }
  }
}

/** @param {any} value @returns {value is Conversation} */
function isConversation(value) {
  return (
    typeof value?.id === "string" &&
    Array.isArray(value.messages) &&
    value.messages.every(
      (/** @type {any} */ m) => (m?.role === "user" || m?.role === "assistant") && typeof m.content === "string",
    )
  );
}

function newId() {
  return `c${Date.now().toString(36)}${Math.random().toString(36).slice(2, 8)}`;
}
