/**
 * A dependency-free client for wsserver's WebSocket protocol v1.
 *
 * Works wherever a standard `WebSocket` exists: browsers, Electron renderers,
 * Node.js 22+ (Node 20 with --experimental-websocket), or anywhere a WebSocket
 * implementation is passed in.
 *
 *     import { WsClient } from "./wsserver.js";
 *
 *     const client = new WsClient("ws://127.0.0.1:8765/");
 *     const stream = client.generate({ prompt: "Once upon a time", max_tokens: 64 });
 *     for await (const text of stream) output.append(text);
 *     const done = await stream.done;          // the server's `done` frame
 *
 * Theory of operation
 * -------------------
 * One socket at a time carries every request. Each request is a
 * {@link GenerationStream}, keyed by its request ID; the socket's message
 * handler routes every frame by ID to its stream. A stream the caller gave up
 * on (`cancel()`, `restart()`, leaving a `for await` loop early) stops
 * accepting text at once: deltas already on the wire for it are dropped here,
 * so late text can never reach the caller. Its `done` promise still settles
 * with the server's `done` frame, which the protocol guarantees is the last
 * frame of that ID.
 *
 * When the socket drops, every request that was sent on it fails with
 * `WsError` code `connection_lost`: the server forgot it, and replaying it
 * could run (and bill) a generation twice, so that decision stays with the
 * caller. Requests made while the client is connecting wait and are sent
 * once the server's `hello` arrives. The client then reconnects with
 * exponential backoff and jitter unless `reconnect: false`.
 *
 * Resumable requests (`resumable: true` on the client or the request) are
 * the exception: the server keeps them through a lost connection, so they do
 * not fail. After the reconnect's `hello` the client sends `resume` with the
 * last `seq` it received, the server replays what may not have arrived, and
 * the stream's iterator just goes on (no gap, no duplicate); the stream emits
 * `resumed`, the client `reconnect`.
 *
 * Besides the answer's text a delta may carry the model's reasoning (a think
 * block the server keeps apart) and parts of its tool calls. Iteration yields
 * the text only; the stream keeps the rest in `reasoning` and `toolCalls`
 * (each a {@link ToolCall}, its arguments joined from their parts) and emits
 * `reasoning` and `toolCall` events as they arrive. `client.resume()` picks up a request a
 * previous page (or process) started, from its id, token and last seq.
 *
 * `client.pull(reference)` downloads a model from the Hugging Face Hub where
 * the server allows it (`hello.pull`): its `pull_progress` frames go to
 * `onProgress`, its one `pull_done` settles `done`. A pull is not resumable
 * across connections: a lost connection fails it with `connection_lost`
 * (the server keeps what it fetched, and pulling again resumes the file).
 *
 * `client.embed(input)` resolves with each input's vector (docs/embeddings.md):
 * one `embed` request, run in the server's model queue and engine beside the
 * streams, its one `embed_done` settles it; aborting its `signal` cancels it.
 * Like a pull it is not resumed: a lost connection fails it.
 *
 * When to reconnect, how long to wait, what a kept request sends, which
 * refused resume is asked again and when to give up is one policy for every
 * wsserver client ({@link reconnectPolicy}, {@link RECONNECT_DEFAULTS}): the
 * Python clients decide alike (wsserver_client/reconnect.py), and the tests
 * of both languages check their code against one table,
 * clients/reconnect-policy.json.
 *
 * @module wsserver
 */

/** The wire protocol this module speaks. */
export const PROTOCOL_VERSION = 1;

/** The subprotocol offered when a token is given. */
export const SUBPROTOCOL = "wsserver.v1";

/** Request IDs the server accepts. */
const ID_RE = /^[A-Za-z0-9_.:-]{1,64}$/;

/**
 * Characters allowed in a `Sec-WebSocket-Protocol` value (an RFC 7230 token).
 * `new WebSocket()` throws a SyntaxError on anything else, so we check first
 * and say why.
 */
const TOKEN_RE = /^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$/;

/** How many finished request IDs (and inputs, for `restart`) to remember. */
const RECENT_LIMIT = 64;

/** @typedef {import("./wsserver.d.ts").GenerateParams} GenerateParams */
/** @typedef {import("./wsserver.d.ts").ImageInput} ImageInput */
/** @typedef {import("./wsserver.d.ts").RequestOptions} RequestOptions */
/** @typedef {import("./wsserver.d.ts").ClientOptions} ClientOptions */
/** @typedef {import("./wsserver.d.ts").ReconnectOptions} ReconnectOptions */
/** @typedef {import("./wsserver.d.ts").ConnectionState} ConnectionState */
/** @typedef {import("./wsserver.d.ts").StreamStatus} StreamStatus */
/** @typedef {import("./wsserver.d.ts").HelloFrame} HelloFrame */
/** @typedef {import("./wsserver.d.ts").DoneFrame} DoneFrame */
/** @typedef {import("./wsserver.d.ts").ServerFrame} ServerFrame */
/** @typedef {import("./wsserver.d.ts").StateEvent} StateEvent */
/** @typedef {import("./wsserver.d.ts").ToolCallPart} ToolCallPart */
/** @typedef {import("./wsserver.d.ts").ToolCallInput} ToolCallInput */
/** @typedef {import("./wsserver.d.ts").SavedToolCall} SavedToolCall */
/** @typedef {import("./wsserver.d.ts").PullOptions} PullOptions */
/** @typedef {import("./wsserver.d.ts").PullHandle} PullHandle */
/** @typedef {import("./wsserver.d.ts").PullProgress} PullProgress */
/** @typedef {import("./wsserver.d.ts").PullDoneFrame} PullDoneFrame */

/**
 * A pull in flight (internal).
 *
 * @typedef {object} PullState
 * @property {string} id
 * @property {Record<string, unknown>} frame
 * @property {PullProgress | null} progress
 * @property {boolean} sent
 * @property {((progress: PullProgress) => void) | undefined} onProgress
 * @property {(done: PullDoneFrame) => void} resolve
 * @property {(error: WsError) => void} reject
 * @property {Promise<PullDoneFrame>} done
 */

/** @typedef {import("./wsserver.d.ts").EmbedOptions} EmbedOptions */
/** @typedef {import("./wsserver.d.ts").EmbedInput} EmbedInput */
/** @typedef {import("./wsserver.d.ts").Embedding} Embedding */
/** @typedef {import("./wsserver.d.ts").EmbedDoneFrame} EmbedDoneFrame */

/**
 * An embed in flight (internal).
 *
 * @typedef {object} EmbedState
 * @property {string} id
 * @property {Record<string, unknown>} frame
 * @property {boolean} sent
 * @property {(result: Embedding) => void} resolve
 * @property {(error: WsError) => void} reject
 */

/**
 * An error for one request, or for the client.
 *
 * `code` is a server error code (`busy`, `duplicate_id`, `unknown_id`,
 * `overloaded`, `internal`, …, including the code of a `done` frame with
 * reason `error`) or one of the client's own: `connection_lost` (the socket
 * dropped while the request was in flight), `closed` (`client.close()` was
 * called), `protocol` (the server broke protocol v1).
 */
export class WsError extends Error {
  /**
   * @param {string} code
   * @param {string} message
   * @param {{ requestId?: string | null, frame?: ServerFrame | null }} [details]
   */
  constructor(code, message, { requestId = null, frame = null } = {}) {
    super(`${code}: ${message}`);
    this.name = "WsError";
    /** @type {string} */
    this.code = code;
    /** @type {string | null} */
    this.requestId = requestId;
    /** @type {ServerFrame | null} */
    this.frame = frame;
  }
}

/**
 * One tool call of the model, joined from its parts so far: the server sends
 * a call's `id` and function `name` first, then its `arguments` (JSON text)
 * in fragments, which are appended here. `parsedArguments` is that text
 * parsed as a JSON object (`null` while it is not one) and `argumentsError`
 * says why it is not (`null` when it is). The server checks a call before it
 * sends it, so an error means an incomplete call (cancelled mid-call) or a
 * server that does not check.
 */
export class ToolCall {
  /**
   * @param {number} index the call's position among the turn's calls
   * @param {string} id what a `tool` message with the result names
   * @param {string} name the function called
   * @param {string} [args] the arguments' JSON text so far
   */
  constructor(index, id, name, args = "") {
    /** @type {number} */
    this.index = index;
    /** @type {string} */
    this.id = id;
    /** @type {string} */
    this.name = name;
    /** @type {string} */
    this.arguments = args;
  }

  /** The arguments as a JSON object, or `null` if they are not one. */
  get parsedArguments() {
    return this.#parse().value;
  }

  /** Why the arguments are not a JSON object, or `null` if they are. */
  get argumentsError() {
    return this.#parse().error;
  }

  /** @returns {{ value: Record<string, unknown> | null, error: string | null }} */
  #parse() {
    let value;
    try {
      value = JSON.parse(this.arguments);
    } catch (error) {
      return { value: null, error: `the arguments are not valid JSON: ${/** @type {Error} */ (error).message}` };
    }
    if (value === null || typeof value !== "object" || Array.isArray(value)) {
      const kind = value === null ? "null" : Array.isArray(value) ? "an array" : typeof value;
      return { value: null, error: `the arguments are JSON but not an object: ${kind}` };
    }
    return { value, error: null };
  }

  /**
   * The call as an assistant message's `tool_calls` entry (OpenAI's shape).
   * @returns {ToolCallInput}
   */
  toMessage() {
    return { id: this.id, type: "function", function: { name: this.name, arguments: this.arguments } };
  }
}

/**
 * A minimal event emitter: `on()` returns a function that removes the
 * listener. A listener that throws does not stop the others or the client;
 * the exception is reported asynchronously, like a DOM event listener's.
 *
 * @template {Record<string, any>} Events
 */
class Emitter {
  /** @type {Map<keyof Events, Set<(detail: any) => void>>} */
  #listeners = new Map();

  /**
   * @template {keyof Events} K
   * @param {K} type
   * @param {(detail: Events[K]) => void} listener
   * @returns {() => void} a function that removes the listener
   */
  on(type, listener) {
    let set = this.#listeners.get(type);
    if (!set) this.#listeners.set(type, (set = new Set()));
    set.add(listener);
    return () => this.off(type, listener);
  }

  /**
   * @template {keyof Events} K
   * @param {K} type
   * @param {(detail: Events[K]) => void} listener
   */
  off(type, listener) {
    this.#listeners.get(type)?.delete(listener);
  }

  /**
   * @template {keyof Events} K
   * @param {K} type
   * @param {Events[K]} detail
   */
  emit(type, detail) {
    const set = this.#listeners.get(type);
    if (!set) return;
    for (const listener of [...set]) {
      try {
        listener(detail);
      } catch (error) {
        queueMicrotask(() => {
          throw error;
        });
      }
    }
  }
}

/**
 * One request: iterate it for text; `done` settles with the server's `done`
 * frame.
 *
 * Iteration yields strings. When the consumer is slower than the network,
 * text that arrived meanwhile is merged into one string: nothing is lost or
 * reordered, and a busy UI handles fewer, larger pieces. Leaving the loop
 * early (`break`, `return`, an exception) cancels the request.
 *
 * Events (`stream.on(type, listener)`): `queued` ({position}), `started`,
 * `reasoning` (each frame's reasoning text), `delta` (each frame's text, when
 * it has some), `toolCall` ({call, arguments}: a part of a tool call, after
 * the frame's text), `done` (the frame), `error` (a WsError).
 *
 * @extends {Emitter<import("./wsserver.d.ts").StreamEvents>}
 */
export class GenerationStream extends Emitter {
  /** @type {WsClient} */
  #client;
  /** @type {string[]} */
  #chunks = [];
  /** @type {((value: void) => void) | null} */
  #wake = null;
  /** True once iteration can yield nothing more. */
  #ended = false;
  /** True once the caller gave up; text for this ID is dropped from then on. */
  #abandoned = false;
  /** @type {WsError | null} */
  #error = null;
  /** @type {(frame: DoneFrame) => void} */
  #resolveDone = () => {};
  /** @type {(error: WsError) => void} */
  #rejectDone = () => {};
  #nextSeq = 0;
  #iterating = false;
  /** Set by `started` for a resumable request: what a resume presents. @type {string | null} */
  resumeToken = null;
  /** Between a lost connection and the server's `resumed` (internal). */
  _suspended = false;
  /** A `resume` was sent and not yet answered (internal). */
  _resuming = false;
  /** `resume` frames sent since the last success (internal). */
  _resumeAttempts = 0;
  /** When (`performance.now()`) the connection this stream is kept from was lost (internal). */
  _lostAt = 0;
  /** True once the server showed it accepted the request (queued, started or text). */
  #acknowledged = false;

  /**
   * @param {WsClient} client
   * @param {string} id
   * @param {Record<string, unknown>} frame the request frame to send
   * @param {Record<string, unknown>} input the request's full input, for a later restart
   * @internal use `client.generate()` / `client.restart()`
   */
  constructor(client, id, frame, input) {
    super();
    this.#client = client;
    /** The request ID (unique on its connection). */
    this.id = id;
    /** The frame sent (or to be sent) to the server. */
    this.frame = frame;
    /** The request's input (prompt or messages and options), as `restart` would reuse it. */
    this.input = input;
    /** @type {StreamStatus} */
    this.status = "pending";
    /** The queue position while queued, else `null`. @type {number | null} */
    this.position = null;
    /**
     * All text received before the request ended or was cancelled, including
     * any the loop had not taken yet when it was cancelled.
     */
    this.text = "";
    /** All reasoning received (a think block the server kept apart from the text). */
    this.reasoning = "";
    /**
     * A request for several choices (`n`): each choice's text by index (`text`
     * has them all, as they came); its `choice_done` frames in `choiceEnds`.
     * @type {string[]}
     */
    this.choiceTexts = [];
    /** @type {import("./wsserver.d.ts").ChoiceDoneFrame[]} */
    this.choiceEnds = [];
    /** The model's tool calls, in order, joined from their parts so far. @type {ToolCall[]} */
    this.toolCalls = [];
    /** The connection epoch the request was sent on (internal). @type {number} */
    this.epoch = -1;
    /** @type {Promise<DoneFrame>} */
    this.done = new Promise((resolve, reject) => {
      this.#resolveDone = resolve;
      this.#rejectDone = reject;
    });
    // `done` may reject (refused request, lost connection) while nobody
    // awaits it; that must not become an unhandled rejection.
    this.done.catch(() => {});
  }

  /** Whether the request has ended (done, failed or cancelled before it was sent). */
  get finished() {
    return this.status === "done" || this.status === "failed";
  }

  /** Whether the caller cancelled or restarted this request. */
  get abandoned() {
    return this.#abandoned;
  }

  /** The `seq` of the last delta received (-1: none). */
  get lastSeq() {
    return this.#nextSeq - 1;
  }

  /** Whether a lost connection keeps this request (the server can resume it). */
  get resumable() {
    return this.resumeToken !== null && !this.finished;
  }

  /**
   * Cancel in-band. Iteration ends at once and no more text is delivered;
   * resolves with the server's `done` frame (reason `cancelled`, or the
   * natural reason if the request ended first).
   *
   * @returns {Promise<DoneFrame>}
   */
  cancel() {
    this.#client._cancel(this);
    return this.done;
  }

  /**
   * Regenerate: shorthand for `client.restart(this, overrides)`.
   *
   * @param {Partial<GenerateParams>} [overrides]
   * @param {RequestOptions} [options]
   * @returns {GenerationStream}
   */
  restart(overrides = {}, options = {}) {
    return this.#client.restart(this, overrides, options);
  }

  /**
   * Read to the end; resolves with the whole text, the reasoning, the tool
   * calls and the `done` frame.
   *
   * @returns {Promise<{ text: string, reasoning: string, toolCalls: ToolCall[], done: DoneFrame }>}
   */
  async result() {
    for await (const _ of this) {
      // Text accumulates in `this.text`.
    }
    const done = await this.done;
    return { text: this.text, reasoning: this.reasoning, toolCalls: [...this.toolCalls], done };
  }

  /**
   * The answer as the assistant message of a chat's next request: its text
   * (`null` beside tool calls when there is none), its `tool_calls` and, with
   * calls, its `reasoning`: the tool-use loop goes on, and chat templates show
   * that turn's reasoning (an answer without calls ends the turn, whose
   * reasoning templates leave out).
   *
   * @returns {import("./wsserver.d.ts").ChatMessage}
   */
  message() {
    if (this.toolCalls.length === 0) return { role: "assistant", content: this.text };
    /** @type {import("./wsserver.d.ts").ChatMessage} */
    const message = { role: "assistant", content: this.text || null, tool_calls: this.toolCalls.map((call) => call.toMessage()) };
    if (this.reasoning) message.reasoning = this.reasoning;
    return message;
  }

  /** @returns {AsyncIterableIterator<string>} */
  [Symbol.asyncIterator]() {
    if (this.#iterating) throw new Error("a GenerationStream can be iterated only once");
    this.#iterating = true;
    return {
      next: () => this.#next(),
      return: async () => {
        if (!this.finished && !this.#abandoned) this.#client._cancel(this);
        this.#endIteration();
        return { value: undefined, done: true };
      },
      [Symbol.asyncIterator]() {
        return this;
      },
    };
  }

  /** @returns {Promise<IteratorResult<string>>} */
  async #next() {
    for (;;) {
      if (this.#chunks.length > 0) {
        const value = this.#chunks.length === 1 ? this.#chunks[0] : this.#chunks.join("");
        this.#chunks = [];
        return { value, done: false };
      }
      if (this.#ended) {
        if (this.#error) throw this.#error;
        return { value: undefined, done: true };
      }
      await new Promise((resolve) => {
        this.#wake = resolve;
      });
    }
  }

  #signal() {
    const wake = this.#wake;
    this.#wake = null;
    wake?.();
  }

  #endIteration() {
    this.#ended = true;
    this.#signal();
  }

  // ---------------------------------------------------------------- client side
  // Called by WsClient only.

  /**
   * @param {number} epoch
   * @internal
   */
  _markSent(epoch) {
    this.epoch = epoch;
    this.status = "sent";
  }

  /**
   * A stream picked up from an earlier page or process (`client.resume()`).
   * @param {string} token
   * @param {number} afterSeq
   * @param {SavedToolCall[]} [toolCalls] calls begun before afterSeq, to be continued
   * @internal
   */
  _restore(token, afterSeq, toolCalls = []) {
    for (const call of toolCalls) {
      this.toolCalls.push(new ToolCall(call.index, call.id, call.name, call.arguments));
    }
    this.resumeToken = token;
    this.#nextSeq = afterSeq + 1;
    this.#acknowledged = true;
    this._suspended = true;
    this._lostAt = performance.now();
  }

  /**
   * The caller gave up: from now on no text reaches it.
   * @internal
   */
  _abandon() {
    if (this.#abandoned || this.finished) return;
    this.#abandoned = true;
    this.#chunks = [];
    if (this.status !== "pending") this.status = "cancelling";
    this.#endIteration();
  }

  /**
   * Route one frame of this request.
   * @param {ServerFrame} frame
   * @internal
   */
  _handle(frame) {
    if (this.finished) return;
    if (frame.type === "queued" || frame.type === "started" || frame.type === "delta") {
      this.#acknowledged = true;
    }
    switch (frame.type) {
      case "queued":
        if (this.#abandoned) return;
        this.status = "queued";
        this.position = frame.position;
        /** @type {{ position: number, loading?: true, download?: PullProgress }} */
        const detail = { position: frame.position };
        if (frame.loading) detail.loading = true;
        if (frame.download) detail.download = frame.download;
        this.emit("queued", detail);
        return;
      case "started":
        if (typeof frame.resume_token === "string") this.resumeToken = frame.resume_token;
        if (this.#abandoned) return;
        this.status = "running";
        this.position = null;
        this.emit("started", undefined);
        return;
      case "resumed":
        this._suspended = false;
        this._resuming = false;
        this._resumeAttempts = 0;
        if (this.#abandoned) return;
        this.status = "running";
        this.emit("resumed", { afterSeq: frame.after_seq });
        return;
      case "delta":
        if (frame.seq < this.#nextSeq) return; // replayed after a resume, and already here
        if (this.#abandoned) return; // a late frame of a cancelled request
        if (frame.seq !== this.#nextSeq || typeof frame.text !== "string") {
          this._fail(
            new WsError("protocol", `delta seq ${frame.seq} where ${this.#nextSeq} was due`, {
              requestId: this.id,
              frame,
            }),
          );
          return;
        }
        this.#nextSeq += 1;
        // The protocol's order within a frame: reasoning, text, tool calls.
        if (frame.reasoning) {
          this.reasoning += frame.reasoning;
          this.emit("reasoning", frame.reasoning);
        }
        if (typeof frame.choice === "number") {
          this.choiceTexts[frame.choice] = (this.choiceTexts[frame.choice] ?? "") + frame.text;
        }
        if (frame.text) {
          this.text += frame.text;
          this.#chunks.push(frame.text);
          this.#signal();
          this.emit("delta", frame.text);
        }
        for (const part of frame.tool_calls ?? []) this.#joinCall(part);
        return;
      case "choice_done":
        this.choiceEnds.push(frame);
        this.emit("choiceDone", frame);
        return;
      case "done":
        this._finishDone(frame);
        return;
      case "error":
        // Frames are answered in order, so once the request was acknowledged
        // an error is about a later frame: our cancel. A rate-limited cancel
        // leaves the request running, and its `done` still comes.
        if (this.#abandoned && this.#acknowledged && frame.code === "rate_limited") return;
        if (reconnectPolicy.retriesRefusal(frame.code, this._resuming)) {
          // The server has not yet seen the old connection go: ask again soon.
          this._resuming = false;
          this.#client._retryResume(this);
          return;
        }
        this._fail(new WsError(frame.code, frame.message, { requestId: this.id, frame }));
        return;
      default:
        return;
    }
  }

  /** @param {ToolCallPart} part */
  #joinCall(part) {
    let call = this.toolCalls.find((c) => c.index === part.index);
    if (!call) {
      call = new ToolCall(part.index, part.id ?? "", part.name ?? "");
      this.toolCalls.push(call);
    }
    call.arguments += part.arguments ?? "";
    this.emit("toolCall", { call, arguments: part.arguments ?? "" });
  }

  /**
   * @param {DoneFrame} frame
   * @internal
   */
  _finishDone(frame) {
    if (this.finished) return;
    this.status = "done";
    this.position = null;
    if (frame.reason === "error" && !this.#abandoned) {
      const code = frame.error?.code ?? "internal";
      const message = frame.error?.message ?? "generation failed";
      this.#error = new WsError(code, message, { requestId: this.id, frame });
      this.emit("error", this.#error);
    }
    this.#endIteration();
    this.#resolveDone(frame);
    this.emit("done", frame);
  }

  /**
   * The request ended without a `done` frame: refused, lost, or closed.
   * @param {WsError} error
   * @internal
   */
  _fail(error) {
    if (this.finished) return;
    this.status = "failed";
    this.position = null;
    if (!this.#abandoned) this.#error = error;
    this.#endIteration();
    this.#rejectDone(error);
    this.emit("error", error);
  }
}

/**
 * The reconnect/resume policy's numbers, the Python clients' too
 * (wsserver_client/reconnect.py: ReconnectPolicy, in seconds). Why these:
 * docs/protocol.md, "Resuming a stream".
 *
 * @type {Readonly<Required<ReconnectOptions>>}
 */
export const RECONNECT_DEFAULTS = Object.freeze({
  initialDelayMs: 100,
  maxDelayMs: 1000,
  factor: 2,
  jitter: 0.25,
  maxAttempts: Infinity,
  resumeTimeoutMs: 30_000,
});

/**
 * The reconnect/resume policy's decisions, as plain functions of plain
 * values: the client calls them, and clients/js/test/reconnect-policy.test.js
 * checks them against clients/reconnect-policy.json, the table the Python
 * clients' test reads too.
 */
export const reconnectPolicy = Object.freeze({
  /** The error codes of a kept request given up: no connection in time, or its resume refused to the end. */
  gaveUp: Object.freeze({ reconnecting: "connection_lost", resuming: "already_attached" }),

  /**
   * The wait before try `attempt` (1, 2, …) after a lost connection or a
   * refused resume: `initialDelayMs`, times `factor` each try, at most
   * `maxDelayMs`, less up to `jitter` of it as `draw` (in [0, 1)) says.
   *
   * @param {Required<ReconnectOptions>} options
   * @param {number} attempt
   * @param {number} draw
   * @returns {number}
   */
  delayMs(options, attempt, draw) {
    const base = Math.min(options.maxDelayMs, options.initialDelayMs * options.factor ** (attempt - 1));
    return base * (1 - options.jitter * draw);
  },

  /**
   * The wait before try `attempt`, `elapsedMs` after the connection was lost,
   * or `null`: give up, that try would start after `resumeTimeoutMs`.
   *
   * @param {Required<ReconnectOptions>} options
   * @param {number} attempt
   * @param {number} elapsedMs
   * @param {number} draw
   * @returns {number | null}
   */
  waitMs(options, attempt, elapsedMs, draw) {
    const delayMs = reconnectPolicy.delayMs(options, attempt, draw);
    return elapsedMs + delayMs <= options.resumeTimeoutMs ? delayMs : null;
  },

  /**
   * Whether a live request survives a lost connection, to be resumed: only a
   * resumable one, and only if the client reconnects. Any other fails with
   * `connection_lost`.
   *
   * @param {boolean} resumable
   * @param {boolean} reconnecting
   * @returns {boolean}
   */
  keepsOnLoss(resumable, reconnecting) {
    return resumable && reconnecting;
  },

  /**
   * What a kept request sends on the new connection: `resume` after the last
   * `seq` received, or, if the caller gave it up meanwhile, `cancel` with its
   * token (else the server holds it until its grace runs out).
   *
   * @param {{ id: string, resumeToken: string | null, lastSeq: number, abandoned: boolean }} request
   * @returns {Record<string, unknown>}
   */
  resumeFrame(request) {
    const { id, resumeToken, lastSeq, abandoned } = request;
    if (abandoned) return { type: "cancel", id, resume_token: resumeToken };
    return { type: "resume", id, resume_token: resumeToken, after_seq: lastSeq };
  },

  /**
   * Whether an `error` about a request is retried rather than failing it:
   * only `already_attached` in answer to our `resume`.
   *
   * @param {string} code
   * @param {boolean} resuming
   * @returns {boolean}
   */
  retriesRefusal(code, resuming) {
    return resuming && code === "already_attached";
  },
});

/**
 * A connection to wsserver that reconnects by itself.
 *
 * Events (`client.on(type, listener)`): `state` ({state, previous, attempt,
 * delayMs, code, reason}), `hello` (the server's hello frame), `frame` (every
 * frame as received, before routing — for logging and tests), `error`
 * (a WsError not tied to a live request).
 *
 * @extends {Emitter<import("./wsserver.d.ts").ClientEvents>}
 */
export class WsClient extends Emitter {
  /** @type {WebSocket | null} */
  #ws = null;
  /** Incremented for every socket; frames and closes of an old socket are ignored. */
  #epoch = 0;
  /** @type {ConnectionState} */
  #state = "closed";
  /** Failed attempts since the last successful hello. */
  #attempt = 0;
  /** @type {ReturnType<typeof setTimeout> | null} */
  #timer = null;
  /** @type {Map<string, GenerationStream>} live requests by ID */
  #streams = new Map();
  /** @type {GenerationStream[]} requests waiting for the connection */
  #outbox = [];
  /** @type {Map<string, GenerationStream>} recently finished requests, for restart */
  #recent = new Map();
  /** @type {Map<string, PullState>} pulls not ended, by ID */
  #pulls = new Map();
  /** @type {Map<string, EmbedState>} embeds not ended, by ID */
  #embeds = new Map();
  /** @type {HelloFrame | null} */
  #hello = null;
  #closedByUser = false;
  #counter = 0;
  #prefix;
  /** @type {Required<ReconnectOptions> | null} */
  #reconnect;
  /** @type {string[] | undefined} */
  #protocols;
  /** @type {typeof WebSocket} */
  #WebSocket;
  /** @type {(() => void) | null} */
  #onlineCleanup = null;

  /**
   * @param {string | URL} url a ws:// or wss:// URL
   * @param {ClientOptions} [options]
   */
  constructor(url, options = {}) {
    super();
    /** The server URL. */
    this.url = String(url);
    const { token, reconnect = true, connect = true, idPrefix, resumable = false } = options;
    /** Ask for every request to be resumable (a request's own `resumable` wins). */
    this.resumable = resumable;
    const impl = options.WebSocket ?? globalThis.WebSocket;
    if (typeof impl !== "function") {
      throw new TypeError("no WebSocket implementation: pass options.WebSocket");
    }
    this.#WebSocket = impl;
    if (token != null && token !== "") {
      if (!TOKEN_RE.test(token)) {
        throw new TypeError(
          "the token must be an RFC 7230 token (letters, digits and !#$%&'*+-.^_`|~) " +
            "to travel as a Sec-WebSocket-Protocol value; use a hex or base64url token",
        );
      }
      this.#protocols = [SUBPROTOCOL, `bearer.${token}`];
    }
    if (reconnect === false) this.#reconnect = null;
    else this.#reconnect = { ...RECONNECT_DEFAULTS, ...(reconnect === true ? {} : reconnect) };
    if (idPrefix !== undefined && !/^[A-Za-z0-9_.:-]{1,40}$/.test(idPrefix)) {
      throw new TypeError("idPrefix must be 1-40 characters of A-Z a-z 0-9 _ . : -");
    }
    this.#prefix = idPrefix ?? randomPrefix();
    if (connect) this.connect();
  }

  /** The connection state. @returns {ConnectionState} */
  get state() {
    return this.#state;
  }

  /** The server's `hello` of the current connection (null until it arrives). */
  get hello() {
    return this.#hello;
  }

  /** Incremented for every new socket (a new server-side session). */
  get epoch() {
    return this.#epoch;
  }

  /**
   * Connect now: the first time, or to retry at once while `reconnecting`
   * (or after `close()`). Does nothing while connecting or open.
   */
  connect() {
    if (this.#state === "connecting" || this.#state === "open") return;
    this.#closedByUser = false;
    this.#clearTimer();
    this.#watchOnline();
    this.#openSocket();
  }

  /**
   * Resolves with the server's `hello` once the connection is open; rejects
   * if the client is closed before that.
   *
   * @returns {Promise<HelloFrame>}
   */
  ready() {
    if (this.#state === "open" && this.#hello) return Promise.resolve(this.#hello);
    return new Promise((resolve, reject) => {
      const offHello = this.on("hello", (hello) => {
        offHello();
        offState();
        resolve(hello);
      });
      const offState = this.on("state", ({ state }) => {
        if (state === "closed") {
          offHello();
          offState();
          reject(new WsError("closed", "the client is closed"));
        }
      });
    });
  }

  /**
   * Close the connection and stop reconnecting. Requests in flight or waiting
   * fail with code `closed`.
   *
   * @param {number} [code]
   * @param {string} [reason]
   */
  close(code = 1000, reason = "") {
    this.#closedByUser = true;
    this.#clearTimer();
    this.#onlineCleanup?.();
    this.#onlineCleanup = null;
    const ws = this.#ws;
    this.#ws = null;
    this.#epoch += 1;
    if (ws) {
      detach(ws);
      try {
        ws.close(code, reason);
      } catch {
        ws.close();
      }
    }
    this.#failAll(new WsError("closed", "the client was closed"), true);
    this.#setState("closed", {});
  }

  /** A fresh request ID. */
  newId() {
    this.#counter += 1;
    return `${this.#prefix}-${this.#counter}`;
  }

  /**
   * Start a request. Returns at once; the request is sent now, or when the
   * connection opens.
   *
   * @param {GenerateParams} params `prompt` or `messages`, and sampling options
   * @param {RequestOptions} [options]
   * @returns {GenerationStream}
   */
  generate(params, options = {}) {
    const input = clean(params);
    // A request for several choices (`n`) is not resumable.
    const several = typeof input.n === "number" && input.n > 1;
    if (this.resumable && !("resumable" in input) && !several) input.resumable = true;
    const id = this.#takeId(options.id);
    const frame = { type: "generate", id, ...input };
    return this.#submit(new GenerationStream(this, id, frame, input), options);
  }

  /**
   * Regenerate: cancel `old` if it still runs (its late text is dropped), then
   * run its input again with `overrides` (for example a new `seed` or
   * `temperature`). On the connection `old` ran on, this is one in-band
   * `restart` frame; if that connection is gone, the client sends the
   * remembered input as a new `generate` instead.
   *
   * @param {GenerationStream | string} old the stream or its ID
   * @param {Partial<GenerateParams>} [overrides]
   * @param {RequestOptions} [options]
   * @returns {GenerationStream}
   */
  restart(old, overrides = {}, options = {}) {
    const oldId = typeof old === "string" ? old : old.id;
    const previous =
      typeof old === "string" ? (this.#streams.get(old) ?? this.#recent.get(old)) : old;
    const changes = clean(overrides);
    if (this.resumable && !("resumable" in changes)) changes.resumable = true;
    const id = this.#takeId(options.id);
    /** @type {Record<string, unknown>} */
    let input = changes;
    if (previous) {
      input = { ...previous.input, ...changes };
      if ("prompt" in changes) delete input.messages;
      else if ("messages" in changes) delete input.prompt;
    }
    let frame;
    const sameConnection =
      previous && previous.status !== "pending" && previous.epoch === this.#epoch && this.#state === "open";
    if (!previous || sameConnection) {
      frame = { type: "restart", id: oldId, new_id: id, ...changes };
    } else {
      // The server never saw `old` (still waiting to be sent) or has
      // forgotten it (another connection): send its input afresh.
      frame = { type: "generate", id, ...input };
    }
    if (previous) this._cancel(previous, frame.type === "restart");
    return this.#submit(new GenerationStream(this, id, frame, input), options);
  }

  /**
   * Cancel a request by ID. Resolves with its `done` frame, or `null` if this
   * client knows no live request of that ID.
   *
   * @param {string} id
   * @returns {Promise<DoneFrame | null>}
   */
  cancel(id) {
    const stream = this.#streams.get(id);
    if (!stream) return Promise.resolve(null);
    return stream.cancel();
  }

  /**
   * Pick up a resumable request that an earlier page (or process) started —
   * after a reload, say, with the id, token and last seq it kept. The stream
   * yields the text after `afterSeq`; it is resumed once the connection is
   * open. It fails with `unknown_id` if the server no longer holds it.
   *
   * `toolCalls` are the stream's calls as they were at `afterSeq` (their
   * `index`, `id`, `name` and `arguments`): the parts that follow are
   * appended to them.
   *
   * @param {{ id: string, resumeToken: string, afterSeq: number, toolCalls?: SavedToolCall[] }} saved
   * @param {RequestOptions} [options]
   * @returns {GenerationStream}
   */
  resume(saved, options = {}) {
    const id = this.#takeId(saved.id);
    const stream = new GenerationStream(this, id, { type: "resume", id }, {});
    stream._restore(saved.resumeToken, saved.afterSeq, saved.toolCalls);
    this.#submit(stream, { ...options, id });
    return stream;
  }

  /**
   * Download a model from the Hugging Face Hub onto the server, which serves
   * it once `done` resolves with reason `complete` (its `model` member).
   * Where the server does not allow it (`hello.pull` is not true) `done`
   * rejects with code `pull_not_allowed`. `done` resolves with the
   * `pull_done` frame (`complete`, `cancelled` or `error`); it rejects with a
   * `WsError` if the pull is refused (`bad_reference`, `busy`, …) or its
   * connection is lost.
   *
   * @param {string} reference `org/repo[:QUANT]`, `org/repo/file.gguf`, `@revision` after
   * @param {PullOptions} [options]
   * @returns {PullHandle}
   */
  pull(reference, options = {}) {
    const id = this.#takeId(options.id);
    /** @type {(done: PullDoneFrame) => void} */
    let resolve = () => {};
    /** @type {(error: WsError) => void} */
    let reject = () => {};
    /** @type {Promise<PullDoneFrame>} */
    const done = new Promise((res, rej) => {
      resolve = res;
      reject = rej;
    });
    /** @type {PullState} */
    const state = {
      id,
      frame: { type: "pull", id, model: reference },
      progress: null,
      sent: false,
      onProgress: options.onProgress,
      resolve,
      reject,
      done,
    };
    this.#pulls.set(id, state);
    const cancel = () => this.#cancelPull(state);
    const signal = options.signal;
    if (signal) {
      if (signal.aborted) queueMicrotask(cancel);
      else {
        signal.addEventListener("abort", cancel, { once: true });
        done.finally(() => signal.removeEventListener("abort", cancel)).catch(() => {});
      }
    }
    if (this.#closedByUser) {
      queueMicrotask(() => this.#endPull(state, new WsError("closed", "the client is closed")));
    } else if (this.#state === "open") {
      this.#sendPull(state);
    }
    // Else it goes out with the next hello (#onHello).
    return {
      id,
      done,
      get progress() {
        return state.progress;
      },
      cancel() {
        cancel();
        return done;
      },
    };
  }

  /**
   * Each input's vector, as the server's model returns it (not normalised):
   * `input` is a string, strings, token ids or token-id arrays. Rejects with
   * a `WsError` when the embed is refused or fails (its wire code), when its
   * `signal` aborts (`cancelled`: the server lets it go within a step) or its
   * connection is lost.
   *
   * @param {EmbedInput} input
   * @param {EmbedOptions} [options]
   * @returns {Promise<Embedding>}
   */
  embed(input, options = {}) {
    const id = this.#takeId(options.id);
    /** @type {Record<string, unknown>} */
    const frame = { type: "embed", id, input };
    if (options.model !== undefined) frame.model = options.model;
    /** @type {(result: Embedding) => void} */
    let resolve = () => {};
    /** @type {(error: WsError) => void} */
    let reject = () => {};
    /** @type {Promise<Embedding>} */
    const result = new Promise((res, rej) => {
      resolve = res;
      reject = rej;
    });
    /** @type {EmbedState} */
    const state = { id, frame, sent: false, resolve, reject };
    this.#embeds.set(id, state);
    const signal = options.signal;
    if (signal) {
      const cancel = () => this.#cancelEmbed(state);
      if (signal.aborted) queueMicrotask(cancel);
      else {
        signal.addEventListener("abort", cancel, { once: true });
        result.finally(() => signal.removeEventListener("abort", cancel)).catch(() => {});
      }
    }
    if (this.#closedByUser) {
      queueMicrotask(() => this.#endEmbed(state, new WsError("closed", "the client is closed")));
    } else if (this.#state === "open") {
      this.#sendEmbed(state);
    }
    // Else it goes out with the next hello (#onHello).
    return result;
  }

  // ---------------------------------------------------------------- internals

  /** @param {EmbedState} state */
  #sendEmbed(state) {
    state.sent = true;
    this.#send(state.frame);
  }

  /** @param {EmbedState} state */
  #cancelEmbed(state) {
    if (this.#embeds.get(state.id) !== state) return;
    if (state.sent && this.#ws && this.#state === "open") this.#send({ type: "cancel", id: state.id });
    this.#endEmbed(state, new WsError("cancelled", "the embed was cancelled", { requestId: state.id }));
  }

  /**
   * @param {EmbedState} state
   * @param {EmbedDoneFrame | WsError} end
   */
  #endEmbed(state, end) {
    if (this.#embeds.get(state.id) !== state) return;
    this.#embeds.delete(state.id);
    if (end instanceof WsError) {
      state.reject(end);
    } else if (end.reason === "complete") {
      state.resolve({
        vectors: /** @type {number[][]} */ (end.data ?? []),
        model: end.model ?? "",
        promptTokens: end.usage?.prompt_tokens ?? 0,
      });
    } else if (end.reason === "cancelled") {
      state.reject(new WsError("cancelled", "the embed was cancelled", { requestId: state.id }));
    } else {
      const code = end.error?.code ?? "internal";
      state.reject(new WsError(code, end.error?.message ?? "the embed failed", { requestId: state.id }));
    }
  }

  /** @param {PullState} state */
  #sendPull(state) {
    state.sent = true;
    this.#send(state.frame);
  }

  /** @param {PullState} state */
  #cancelPull(state) {
    if (this.#pulls.get(state.id) !== state) return;
    if (!state.sent) {
      // Never sent: what the server would have said.
      this.#endPull(state, { type: "pull_done", id: state.id, reason: "cancelled" });
    } else if (this.#ws && this.#state === "open") {
      this.#send({ type: "cancel", id: state.id });
    }
  }

  /**
   * @param {PullState} state
   * @param {PullDoneFrame | WsError} end
   */
  #endPull(state, end) {
    if (this.#pulls.get(state.id) !== state) return;
    this.#pulls.delete(state.id);
    if (end instanceof WsError) state.reject(end);
    else state.resolve(end);
  }

  /**
   * @param {PullState} state
   * @param {ServerFrame} frame
   */
  #onPullFrame(state, frame) {
    if (frame.type === "pull_progress") {
      state.progress = frame.progress;
      state.onProgress?.(frame.progress);
    } else if (frame.type === "pull_done") {
      this.#endPull(state, frame);
    } else if (frame.type === "error") {
      this.#endPull(state, new WsError(frame.code, frame.message, { requestId: state.id, frame }));
    }
  }

  /**
   * The server refused a resume with `already_attached`: it has not noticed
   * the old connection go. Ask again with a backoff.
   *
   * @param {GenerationStream} stream
   * @internal
   */
  _retryResume(stream) {
    const options = this.#reconnect ?? RECONNECT_DEFAULTS;
    const elapsedMs = performance.now() - stream._lostAt;
    const delayMs = reconnectPolicy.waitMs(options, stream._resumeAttempts, elapsedMs, Math.random());
    if (delayMs === null) {
      const code = reconnectPolicy.gaveUp.resuming;
      this.#finish(stream, new WsError(code, "resume kept being refused", { requestId: stream.id }));
      return;
    }
    const epoch = this.#epoch;
    setTimeout(() => {
      if (epoch === this.#epoch && this.#state === "open" && !stream.finished) this.#resumeStream(stream);
    }, delayMs);
  }

  /** @param {GenerationStream} stream */
  #resumeStream(stream) {
    stream._markSent(this.#epoch);
    const frame = reconnectPolicy.resumeFrame(stream);
    if (stream.abandoned) {
      // Cancelled while away: a cancel, or it would wait out its grace.
      stream.status = "cancelling";
    } else {
      stream.status = "running";
      stream._resuming = true;
      stream._resumeAttempts += 1;
    }
    this.#send(frame);
  }

  /**
   * Abandon a stream and, unless a restart frame does it, cancel it on the server.
   *
   * @param {GenerationStream} stream
   * @param {boolean} [implicit] the restart frame about to be sent cancels it
   * @internal
   */
  _cancel(stream, implicit = false) {
    if (stream.finished || stream.abandoned) return;
    stream._abandon();
    if (stream.status === "pending" && !stream._suspended) {
      // Never sent: nothing to tell the server.
      this.#outbox = this.#outbox.filter((s) => s !== stream);
      this.#streams.delete(stream.id);
      stream._finishDone(localCancelledDone(stream.id));
      this.#remember(stream);
      return;
    }
    if (!implicit && stream.epoch === this.#epoch && this.#ws && this.#state === "open" && !stream._suspended) {
      /** @type {Record<string, unknown>} */
      const frame = { type: "cancel", id: stream.id };
      if (stream.resumeToken !== null) frame.resume_token = stream.resumeToken;
      this.#send(frame);
    }
  }

  /** @param {string | undefined} id */
  #takeId(id) {
    if (id === undefined) return this.newId();
    if (!ID_RE.test(id)) throw new TypeError("a request id is 1-64 characters of A-Z a-z 0-9 _ . : -");
    if (this.#streams.has(id) || this.#pulls.has(id) || this.#embeds.has(id)) {
      throw new TypeError(`request id ${id} is in use`);
    }
    return id;
  }

  /**
   * @param {GenerationStream} stream
   * @param {RequestOptions} options
   */
  #submit(stream, options) {
    if (options.onQueued) stream.on("queued", options.onQueued);
    if (options.onStarted) stream.on("started", options.onStarted);
    if (options.onDelta) stream.on("delta", options.onDelta);
    if (options.onReasoning) stream.on("reasoning", options.onReasoning);
    if (options.onToolCall) stream.on("toolCall", options.onToolCall);
    if (options.onDone) stream.on("done", options.onDone);
    if (options.onError) stream.on("error", options.onError);
    const signal = options.signal;
    if (signal) {
      const abort = () => this._cancel(stream);
      if (signal.aborted) queueMicrotask(abort);
      else {
        signal.addEventListener("abort", abort, { once: true });
        stream.done.finally(() => signal.removeEventListener("abort", abort)).catch(() => {});
      }
    }
    this.#streams.set(stream.id, stream);
    if (this.#closedByUser) {
      queueMicrotask(() => this.#finish(stream, new WsError("closed", "the client is closed")));
    } else if (this.#state === "open") {
      this.#sendRequest(stream);
    } else {
      this.#outbox.push(stream);
    }
    return stream;
  }

  /** @param {GenerationStream} stream */
  #sendRequest(stream) {
    if (stream._suspended) {
      this.#resumeStream(stream);
      return;
    }
    /** @type {{ frame: Record<string, unknown>, uploads: (Blob | Uint8Array)[] }} */
    let packed;
    try {
      packed = packImages(stream.frame, this.#hello?.limits, () => `img-${this.newId()}`);
    } catch (error) {
      const message = error instanceof Error ? error.message : String(error);
      queueMicrotask(() => this.#finish(stream, new WsError("bad_request", message, { requestId: stream.id })));
      return;
    }
    stream._markSent(this.#epoch);
    // The uploads, then the frame that names them, with nothing between: the
    // server's next generate or restart takes every upload.
    for (const data of packed.uploads) this.#ws?.send(data);
    this.#send(packed.frame);
  }

  /** @param {Record<string, unknown>} frame */
  #send(frame) {
    this.#ws?.send(JSON.stringify(frame));
  }

  #openSocket() {
    this.#epoch += 1;
    const epoch = this.#epoch;
    this.#hello = null;
    this.#setState("connecting", { attempt: this.#attempt });
    /** @type {WebSocket} */
    let ws;
    try {
      ws = this.#protocols ? new this.#WebSocket(this.url, this.#protocols) : new this.#WebSocket(this.url);
    } catch (error) {
      // A malformed URL will not get better by retrying.
      this.#failAll(new WsError("closed", `cannot open ${this.url}: ${error}`), true);
      this.#setState("closed", { reason: String(error) });
      return;
    }
    this.#ws = ws;
    ws.onmessage = (event) => {
      if (epoch === this.#epoch) this.#onMessage(event.data);
    };
    ws.onclose = (event) => {
      if (epoch === this.#epoch) this.#onClose(event.code, event.reason);
    };
    // Failures are reported through `close`, which follows `error` in the
    // same task in browsers. Node 20's WebSocket (undici 6) fires only
    // `error` when a connection cannot be opened and stays CONNECTING for
    // ever, so if no `close` came by the next task, close it ourselves with
    // the code a browser reports (1006), and the reconnect goes on.
    ws.onerror = () => {
      setTimeout(() => {
        if (epoch !== this.#epoch || this.#ws !== ws) return;
        this.#onClose(1006, "");
        try {
          ws.close();
        } catch {
          // Already closing or closed: nothing to release.
        }
      }, 0);
    };
  }

  /** @param {unknown} data */
  #onMessage(data) {
    if (typeof data !== "string") {
      this.emit("error", new WsError("protocol", "the server sent a binary frame"));
      return;
    }
    /** @type {ServerFrame} */
    let frame;
    try {
      frame = JSON.parse(data);
    } catch {
      this.emit("error", new WsError("protocol", "the server sent invalid JSON"));
      return;
    }
    if (frame === null || typeof frame !== "object" || typeof frame.type !== "string") {
      this.emit("error", new WsError("protocol", "the server sent a frame without a type"));
      return;
    }
    this.emit("frame", frame);
    if (frame.type === "hello") {
      this.#onHello(frame);
      return;
    }
    const id = "id" in frame ? frame.id : null;
    const pull = typeof id === "string" ? this.#pulls.get(id) : undefined;
    if (pull) {
      this.#onPullFrame(pull, frame);
      return;
    }
    const embed = typeof id === "string" ? this.#embeds.get(id) : undefined;
    if (embed) {
      if (frame.type === "embed_done") this.#endEmbed(embed, frame);
      else if (frame.type === "error") {
        this.#endEmbed(embed, new WsError(frame.code, frame.message, { requestId: embed.id, frame }));
      }
      return;
    }
    const stream = typeof id === "string" ? this.#streams.get(id) : undefined;
    if (stream) {
      stream._handle(frame);
      if (stream.finished) this.#finish(stream);
      return;
    }
    if (frame.type === "error" && !(typeof id === "string" && this.#recent.has(id))) {
      // Not about a live request (an error about a finished one — a cancel
      // that raced the natural end — is expected and dropped).
      this.emit("error", new WsError(frame.code, frame.message, { requestId: id, frame }));
    }
    // Anything else for an unknown or finished ID is a late frame: dropped.
  }

  /** @param {HelloFrame} hello */
  #onHello(hello) {
    if (hello.protocol !== PROTOCOL_VERSION) {
      this.emit(
        "error",
        new WsError("protocol", `server speaks protocol ${hello.protocol}, not ${PROTOCOL_VERSION}`),
      );
    }
    this.#hello = hello;
    this.#attempt = 0;
    this.#setState("open", {});
    this.emit("hello", hello);
    const resumed = [];
    for (const stream of this.#streams.values()) {
      if (stream._suspended && stream.status !== "pending") {
        this.#resumeStream(stream);
        resumed.push(stream.id);
      }
    }
    if (resumed.length > 0) this.emit("reconnect", { epoch: this.#epoch, resumed });
    for (const state of this.#pulls.values()) {
      if (!state.sent && this.#state === "open") this.#sendPull(state);
    }
    for (const state of this.#embeds.values()) {
      if (!state.sent && this.#state === "open") this.#sendEmbed(state);
    }
    const waiting = this.#outbox;
    this.#outbox = [];
    for (const stream of waiting) {
      if (this.#state !== "open") {
        this.#outbox.push(stream);
      } else if (!stream.finished) {
        this.#sendRequest(stream);
      }
    }
  }

  /**
   * @param {number} code
   * @param {string} reason
   */
  #onClose(code, reason) {
    const ws = this.#ws;
    if (ws) detach(ws);
    this.#ws = null;
    this.#hello = null;
    this.#failAll(
      new WsError("connection_lost", `the connection closed (code ${code}${reason ? `, ${reason}` : ""})`),
      false,
    );
    if (this.#closedByUser) return;
    const options = this.#reconnect;
    if (!options || this.#attempt >= options.maxAttempts) {
      this.#failAll(new WsError("closed", "the connection closed and will not reconnect"), true);
      this.#setState("closed", { code, reason });
      return;
    }
    this.#attempt += 1;
    const draw = Math.random();
    // A kept request that this try would reach too late is given up; the
    // connection itself goes on reconnecting, for the requests to come.
    const now = performance.now();
    for (const stream of [...this.#streams.values()]) {
      if (stream._suspended && reconnectPolicy.waitMs(options, this.#attempt, now - stream._lostAt, draw) === null) {
        const error = new WsError(reconnectPolicy.gaveUp.reconnecting, "could not reconnect in time", {
          requestId: stream.id,
        });
        this.#finish(stream, error);
      }
    }
    const delayMs = Math.round(reconnectPolicy.delayMs(options, this.#attempt, draw));
    this.#setState("reconnecting", { attempt: this.#attempt, delayMs, code, reason });
    this.#timer = setTimeout(() => {
      this.#timer = null;
      this.#openSocket();
    }, delayMs);
  }

  /**
   * Fail the requests sent on the lost connection, and also those still
   * waiting to be sent if `waiting` is true.
   *
   * @param {WsError} error
   * @param {boolean} waiting
   */
  #failAll(error, waiting) {
    for (const state of [...this.#embeds.values()]) {
      // Nor are embeds: the server cancels them with the connection.
      if (state.sent || waiting) this.#endEmbed(state, new WsError(error.code, error.message, { requestId: state.id }));
    }
    for (const state of [...this.#pulls.values()]) {
      // Pulls are not resumable: the server leaves a download nobody waits for.
      if (state.sent || waiting) this.#endPull(state, new WsError(error.code, error.message, { requestId: state.id }));
    }
    for (const stream of [...this.#streams.values()]) {
      if (stream.status === "pending" && !waiting) continue;
      if (reconnectPolicy.keepsOnLoss(stream.resumable, !waiting && this.#reconnect !== null)) {
        // The server keeps it: resume it after the reconnect. Still away
        // since an earlier loss, that loss is when its time began.
        if (!stream._suspended) stream._lostAt = performance.now();
        stream._suspended = true;
        stream._resuming = false;
        continue;
      }
      this.#finish(stream, new WsError(error.code, error.message, { requestId: stream.id }));
    }
    if (waiting) this.#outbox = [];
  }

  /**
   * Forget a live request, failing it first if `error` is given.
   *
   * @param {GenerationStream} stream
   * @param {WsError} [error]
   */
  #finish(stream, error) {
    if (error) stream._fail(error);
    if (this.#streams.get(stream.id) === stream) this.#streams.delete(stream.id);
    this.#remember(stream);
  }

  /** @param {GenerationStream} stream */
  #remember(stream) {
    this.#recent.delete(stream.id);
    this.#recent.set(stream.id, stream);
    for (const id of this.#recent.keys()) {
      if (this.#recent.size <= RECENT_LIMIT) break;
      this.#recent.delete(id);
    }
  }

  /**
   * @param {ConnectionState} state
   * @param {Partial<StateEvent>} details
   */
  #setState(state, details) {
    const previous = this.#state;
    this.#state = state;
    this.emit("state", {
      state,
      previous,
      attempt: this.#attempt,
      delayMs: null,
      code: null,
      reason: null,
      ...details,
    });
  }

  #clearTimer() {
    if (this.#timer !== null) clearTimeout(this.#timer);
    this.#timer = null;
  }

  /** In a browser, retry at once when the network comes back. */
  #watchOnline() {
    if (this.#onlineCleanup || typeof globalThis.addEventListener !== "function") return;
    const retry = () => {
      if (this.#state === "reconnecting") this.connect();
    };
    globalThis.addEventListener("online", retry);
    this.#onlineCleanup = () => globalThis.removeEventListener("online", retry);
  }
}

/**
 * Drop `undefined` and `null` members: the server refuses `null` where it
 * expects a number, and an empty form field is naturally `null`.
 *
 * @param {object | null | undefined} params
 * @returns {Record<string, unknown>}
 */
function clean(params) {
  /** @type {Record<string, unknown>} */
  const out = {};
  for (const [key, value] of Object.entries(params ?? {})) {
    if (value !== undefined && value !== null) out[key] = value;
  }
  return out;
}

/**
 * `frame` with its messages' images (and `audio`) in the wire's shape, and the binary
 * frames to send before it (docs/protocol.md, "Images"): each image's bytes
 * as uploads — `<id>\n<bytes>` in pieces that fit `max_frame_bytes` — when
 * the server takes them, else base64 (a `Blob` then cannot be read at once:
 * refused). Strings (base64, data URLs) and `{upload}` go as they are.
 *
 * @param {Record<string, unknown>} frame
 * @param {HelloFrame["limits"] | undefined} limits
 * @param {() => string} newId
 * @returns {{ frame: Record<string, unknown>, uploads: (Blob | Uint8Array)[] }}
 */
function packImages(frame, limits, newId) {
  /** @type {(Blob | Uint8Array)[]} */
  const uploads = [];
  const messages = frame.messages;
  const given = (/** @type {any} */ m, /** @type {string} */ key) => m && Array.isArray(m[key]) && m[key].length;
  if (!Array.isArray(messages) || !messages.some((m) => given(m, "images") || given(m, "audio"))) {
    return { frame, uploads };
  }
  const upload = (limits?.max_upload_bytes ?? 0) > 0;
  const piece = Math.max(1, (limits?.max_frame_bytes ?? 1 << 20) - 65);
  const encoder = new TextEncoder();
  /** @param {ImageInput} image @param {string} where @param {string} noun @returns {ImageInput} */
  const pack = (image, where, noun) => {
    if (typeof image === "string" || (image && typeof image === "object" && "upload" in image)) return image;
    const isBlob = typeof Blob !== "undefined" && image instanceof Blob;
    /** @type {Uint8Array | null} */
    let bytes = null;
    if (image instanceof ArrayBuffer) bytes = new Uint8Array(image);
    else if (ArrayBuffer.isView(image)) bytes = new Uint8Array(image.buffer, image.byteOffset, image.byteLength);
    else if (!isBlob) {
      throw new TypeError(`${where}: ${noun} is a Blob, bytes, a base64 string or {upload}`);
    }
    if (!upload) {
      if (!bytes) {
        throw new TypeError(`${where}: this server takes no uploads; give ${noun} as bytes or base64, not a Blob`);
      }
      return toBase64(bytes);
    }
    const id = newId();
    const head = encoder.encode(`${id}\n`);
    const size = bytes ? bytes.byteLength : /** @type {Blob} */ (image).size;
    for (let at = 0; at < size || at === 0; at += piece) {
      if (bytes) {
        const part = bytes.subarray(at, at + piece);
        const data = new Uint8Array(head.byteLength + part.byteLength);
        data.set(head);
        data.set(part, head.byteLength);
        uploads.push(data);
      } else {
        uploads.push(new Blob([head, /** @type {Blob} */ (image).slice(at, at + piece)]));
      }
      if (size === 0) break;
    }
    return { upload: id };
  };
  const packedMessages = messages.map((message, index) => {
    if (!given(message, "images") && !given(message, "audio")) return message;
    const out = { ...message };
    for (const key of ["images", "audio"]) {
      if (!given(message, key)) continue;
      out[key] = message[key].map((/** @type {ImageInput} */ item, /** @type {number} */ k) =>
        pack(item, `messages[${index}].${key}[${k}]`, key === "audio" ? "a sound" : "an image"),
      );
    }
    return out;
  });
  return { frame: { ...frame, messages: packedMessages }, uploads };
}

/**
 * @param {Uint8Array} bytes
 * @returns {string}
 */
function toBase64(bytes) {
  let text = "";
  for (let at = 0; at < bytes.byteLength; at += 0x8000) {
    text += String.fromCharCode(...bytes.subarray(at, at + 0x8000));
  }
  return btoa(text);
}

/** @param {WebSocket} ws */
function detach(ws) {
  ws.onmessage = null;
  ws.onclose = null;
  ws.onerror = null;
}

/**
 * The `done` a request cancelled before it was sent gets: the server never
 * saw it, so the client writes what the server would have said.
 *
 * @param {string} id
 * @returns {DoneFrame}
 */
function localCancelledDone(id) {
  return {
    type: "done",
    id,
    reason: "cancelled",
    usage: { prompt_tokens: 0, completion_tokens: 0 },
    timings: { queued_ms: 0, ttft_ms: null, total_ms: 0, tokens_per_s: 0 },
    local: true,
  };
}

function randomPrefix() {
  const bytes = new Uint8Array(4);
  if (globalThis.crypto?.getRandomValues) globalThis.crypto.getRandomValues(bytes);
  else for (let i = 0; i < bytes.length; i++) bytes[i] = Math.floor(Math.random() * 256);
  return "r" + Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
}

/**
 * The module's exports, typed as wsserver.d.ts declares them. Nothing reads
 * this object at run time: it is here so that `tsc -p clients/js` (run by
 * scripts/lint and the test suite) checks each export — constructor,
 * members, parameter and return types — against the hand-written
 * declarations, and fails when the two drift apart.
 *
 * @type {typeof import("./wsserver.d.ts")}
 */
const declaredExports = {
  PROTOCOL_VERSION,
  SUBPROTOCOL,
  RECONNECT_DEFAULTS,
  reconnectPolicy,
  WsError,
  ToolCall,
  GenerationStream,
  WsClient,
};
void declaredExports;
