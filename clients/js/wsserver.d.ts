/**
 * Types for wsserver.js, the browser/Electron/Node client of wsserver's
 * WebSocket protocol v1 (docs/protocol.md).
 */

export declare const PROTOCOL_VERSION: 1;
/** The subprotocol offered, with `bearer.<token>`, when a token is given. */
export declare const SUBPROTOCOL: "wsserver.v1";

// ------------------------------------------------------------------ frames

/** A call an assistant message made (OpenAI's shape); `arguments` is JSON text. */
export interface ToolCallInput {
  id: string;
  type?: "function";
  function: { name: string; arguments?: string };
}

export interface ChatMessage {
  role: "system" | "developer" | "user" | "assistant" | "tool";
  /** `null` only on an assistant message that carries `tool_calls`. */
  content: string | null;
  tool_calls?: ToolCallInput[];
  /** Required on a `tool` message: the call it answers. */
  tool_call_id?: string;
  name?: string;
  /**
   * An assistant message's reasoning before its answer (its think block): send
   * it back in a tool-use loop so that the chat template shows it (Qwen 3's
   * does for the messages after the last user message).
   */
  reasoning?: string | null;
  /**
   * A user message's images (a model served with a vision projector), read
   * before its text in order. Bytes (`Blob`, `File`, `ArrayBuffer`, a typed
   * array) go ahead of the request as uploads in binary frames when the
   * server takes them (`hello.limits.max_upload_bytes` > 0), else as base64;
   * a `Blob` needs uploads (the client cannot read it at once). A string is
   * base64 or a `data:` URL, sent as is; `{upload}` names an upload the
   * caller sent itself (docs/protocol.md, "Images").
   */
  images?: ImageInput[];
  /**
   * A user message's sounds (WAV, MP3 or FLAC files; a model served with an
   * audio projector), read after its images, before its text: taken as
   * `images` are (docs/protocol.md, "Audio").
   */
  audio?: ImageInput[];
}

/** An image of a message's `images`. */
export type ImageInput = Blob | ArrayBuffer | ArrayBufferView | string | { upload: string };

/** OpenAI's function tool: `parameters` is a JSON Schema of an object. */
export interface Tool {
  type: "function";
  function: {
    /** 1-64 characters of A-Z a-z 0-9 _ . : - */
    name: string;
    description?: string;
    parameters?: Record<string, unknown>;
    strict?: boolean;
  };
}

/** The input and sampling options of a request. Give `prompt` or `messages`. */
export interface GenerateParams {
  prompt?: string;
  messages?: ChatMessage[];
  /** Integer ≥ 1, at most `hello.limits.max_tokens`. */
  max_tokens?: number;
  /** ≥ 0. */
  temperature?: number;
  /** In [0, 1]. */
  top_p?: number;
  /** Integer ≥ 0 (0 = no limit). */
  top_k?: number;
  /** Integer in [0, 2**32). */
  seed?: number;
  /** A stop string or up to 4 of them. */
  stop?: string | string[];
  /** Keep the request through a lost connection (docs/protocol.md, "Resuming a stream"). */
  resumable?: boolean;
  // The rest of llama-server's sampler chain (docs/protocol.md, "The sampler chain").
  /** In [0, 1]; default 0.05. */
  min_p?: number;
  /** In [0, 1]; default 1 (off). */
  typical_p?: number;
  /** In (0, 10]; default 1 (off). */
  repeat_penalty?: number;
  /** Integer in [-1, 2**20]; default 64 (-1 = the context, 0 = off). */
  repeat_last_n?: number;
  /** In [-2, 2]; default 0. */
  presence_penalty?: number;
  /** In [-2, 2]; default 0. */
  frequency_penalty?: number;
  /** Token id (or text) → bias in [-100, 100], or `false` to ban; at most 1024. */
  logit_bias?: Record<string, number | false> | Array<[number | string, number | false]>;
  /** In [0, 100]; default 0 (DRY off). */
  dry_multiplier?: number;
  /** In [1, 100]; default 1.75. */
  dry_base?: number;
  /** Integer ≥ 0; default 2. */
  dry_allowed_length?: number;
  /** Integer in [-1, 2**20]; default -1 (the context). */
  dry_penalty_last_n?: number;
  /** Up to 16 strings of 1-64 characters. */
  dry_sequence_breakers?: string[];
  /** In [0, 1]; default 0 (XTC off). */
  xtc_probability?: number;
  /** In [0, 1]; default 0.1. */
  xtc_threshold?: number;
  /** A GBNF grammar (with a `root` rule) the output must match. */
  grammar?: string;
  /** A JSON Schema the output must validate against (not with `grammar`). */
  json_schema?: Record<string, unknown> | true;
  /** Function tools the chat template shows the model (with `messages` only). */
  tools?: Tool[];
  /** Only with `tools`: "none" hides them from the model; "required" or a named
   * function forces a call (refused with `unsupported_option` by an engine that cannot). */
  tool_choice?: "auto" | "none" | "required" | { type: "function"; function: { name: string } };
  /** Only with `tools`: false takes at most one call per turn. */
  parallel_tool_calls?: boolean;
  /** Extra chat-template variables, e.g. `{enable_thinking: false}` (with `messages` only). */
  chat_template_kwargs?: Record<string, unknown>;
  /** "auto": a think block comes as `reasoning`, apart from `text`; "none": left in `text`. */
  reasoning_format?: "none" | "auto";
  /** Integer >= 0: at most this many tokens inside the think block, then the
   * engine closes it and the model answers; -1 = no budget. With `messages` only. */
  reasoning_budget_tokens?: number;
  /** Each `delta` carries its tokens' log-probabilities (`DeltaFrame.logprobs`). */
  logprobs?: boolean;
  /** Integer in [0, 20]: alternatives per token; only with `logprobs: true`. Default 0. */
  top_logprobs?: number;
  /** Several choices for the prompt (1-128, at most the model's `parallel`): each
   * delta carries its `choice`, a `choice_done` ends each; not resumable. Default 1. */
  n?: number;
  /**
   * The model to serve it: one of `HelloFrame.models`' names (default: the
   * server's default model, `HelloFrame.model`). An unknown name is refused
   * with `model_not_found`; a model not loaded yet is loaded first.
   */
  model?: string;
  /**
   * Seconds the model stays loaded once idle after this request: 0 = unloaded
   * at once, -1 = until its memory is needed. Default: the model's keep_alive_s.
   */
  keep_alive?: number;
  /**
   * Speculative decoding with n-gram drafts (the llama engine), on a server
   * whose backend.llama.speculative is "auto" (the default; with "off"
   * nothing drafts): "auto" where it pays, "off" never for this request. Meant for
   * speed only; on quantized weights a greedy answer can part at a near tie.
   */
  speculative?: "auto" | "off";
}

export interface Limits {
  max_frame_bytes: number;
  max_prompt_chars: number;
  max_messages: number;
  max_tokens: number;
  default_max_tokens: number;
  /**
   * Bytes of image uploads (binary frames) the connection may hold until its
   * next request; 0 (or absent, from a server before uploads): none taken,
   * and the client sends images as base64 inside the frame.
   */
  max_upload_bytes: number;
}

export interface HelloFrame {
  type: "hello";
  protocol: number;
  server: string;
  model: string;
  limits: Limits;
  /**
   * The sampler-chain and structured-output options the engine honours
   * (sorted); any other given a value that matters is refused with
   * `unsupported_option`. Absent from a server before this member.
   */
  honours?: string[];
  /** Every model the server serves (`model` is the default). Absent from a server before it. */
  models?: ModelInfo[];
  /** Whether this connection may `pull` models. Absent from a server before it. */
  pull?: boolean;
}

/** One served model, as `hello` lists it. */
export interface ModelInfo {
  name: string;
  state: "loaded" | "loading" | "unloaded";
  /** Tokens per request (prompt + completion); null when the engine does not say. */
  n_ctx: number | null;
  /** Requests it runs at once (0 = no limit). */
  parallel: number;
  max_waiting: number;
  /** More names requests may give for it (its configured `aliases`). Absent from a server before it. */
  aliases?: string[];
  /**
   * Whether the loaded model has a chat template: `false` is a base model,
   * which continues text rather than answering. Absent when not known.
   */
  chat_template?: boolean;
  /** What the loaded model takes in: `["text"]`, or `["text", "image"]`. Absent when not known (not loaded). */
  input_modalities?: string[];
}

export interface QueuedFrame {
  type: "queued";
  id: string;
  position: number;
  /** Present (true) while the request's model is being loaded. */
  loading?: true;
  /** Present while the request's model (a Hub reference) is being downloaded: how far. */
  download?: PullProgress;
}

/** How far a pull is, every file of it together (docs/models.md). */
export interface PullProgress {
  status: "resolving" | "checking" | "downloading" | "verifying" | "done";
  /** Bytes in place: cached, resumed or downloaded. */
  completed: number;
  /** Bytes of every file of the pull (0 until the Hub has said). */
  total: number;
  /** The file being worked on, its path in the repository. */
  file?: string;
  /** Bytes per second over the last seconds. */
  rate?: number;
  /** Seconds left at that rate. */
  eta_s?: number;
}

export interface PullProgressFrame {
  type: "pull_progress";
  id: string;
  progress: PullProgress;
}

/** The end of a pull: exactly one per accepted pull. */
export interface PullDoneFrame {
  type: "pull_done";
  id: string;
  reason: "complete" | "cancelled" | "error";
  /** `complete`: the model as the server now serves it. */
  model?: ModelInfo;
  /** `complete`: bytes that came over the network (0: all were cached). */
  downloaded?: number;
  /** `error`: why (`hub_not_found`, `disk_full`, …). */
  error?: { code: ErrorCode; message: string };
}

export interface PullOptions {
  /** The request ID (default: a fresh one). */
  id?: string;
  /** Called with each `pull_progress`. */
  onProgress?: (progress: PullProgress) => void;
  /** Aborting it cancels the pull. */
  signal?: AbortSignal;
}

/** An `embed`'s input: OpenAI's shapes (none empty). */
export type EmbedInput = string | string[] | number[] | number[][];

export interface EmbedOptions {
  /** The request ID (default: a fresh one). */
  id?: string;
  /** The model (default: the server's default model). */
  model?: string;
  /** Aborting it cancels the embed (the promise rejects with `cancelled`). */
  signal?: AbortSignal;
}

/** What `client.embed()` resolves with. */
export interface Embedding {
  /** Each input's vector, in input order, as the model returns it (not normalised). */
  vectors: number[][];
  model: string;
  /** The tokens the server's engine read. */
  promptTokens: number;
}

export interface EmbedDoneFrame {
  type: "embed_done";
  id: string;
  reason: "complete" | "cancelled" | "error";
  /** `complete`: the model that embedded. */
  model?: string;
  /** `complete`: each vector, as floats (or base64 strings with `encoding_format` base64). */
  data?: number[][] | string[];
  encoding_format?: "float" | "base64";
  usage?: { prompt_tokens: number };
  /** `error`: why (`too_large` for an input over the model's length, …). */
  error?: { code: ErrorCode; message: string };
}

/** A pull in flight (`client.pull()`). */
export interface PullHandle {
  readonly id: string;
  /** The last progress received, or `null`. */
  readonly progress: PullProgress | null;
  /**
   * Resolves with the `pull_done` frame; rejects with a `WsError` if the pull
   * was refused or its connection lost.
   */
  readonly done: Promise<PullDoneFrame>;
  /** Cancel it (its `pull_done`, reason `cancelled`, comes at once); returns `done`. */
  cancel(): Promise<PullDoneFrame>;
}

export interface StartedFrame {
  type: "started";
  id: string;
  /** Only for a resumable request. */
  resume_token?: string;
}

export interface ResumedFrame {
  type: "resumed";
  id: string;
  after_seq: number;
}

/** One alternative at a position (OpenAI's chat shape). */
export interface TopLogprob {
  token: string;
  /** Natural log of the probability, <= 0 (-9999: never). */
  logprob: number;
  /** The token's raw bytes (a byte token may be part of a character). */
  bytes: number[];
}

/** One generated token: the model's own distribution, before the sampler chain. */
export interface TokenLogprob extends TopLogprob {
  /** The most likely tokens at this position, most likely first. */
  top_logprobs: TopLogprob[];
}

export interface DeltaFrame {
  type: "delta";
  id: string;
  seq: number;
  /** The answer's text; may be "" when the frame carries only reasoning or `logprobs`. */
  text: string;
  /** The model's reasoning (a think block), before `text`; absent when none. */
  reasoning?: string;
  /** Only for a request with `logprobs: true`: one entry per token merged into this delta. */
  logprobs?: TokenLogprob[];
  /** Parts of the model's tool calls (a request with `tools`), after `text`. */
  tool_calls?: ToolCallPart[];
  /** Which choice it belongs to: only for a request for several (`n` > 1). */
  choice?: number;
}

/** One choice of a request for several (`n`) ended; the request's `done` follows the last. */
export interface ChoiceDoneFrame {
  type: "choice_done";
  id: string;
  choice: number;
  reason: "stop" | "length" | "tool_calls";
  usage: { completion_tokens: number; reasoning_tokens?: number };
  stop_sequence?: string;
}

/** A part of a tool call: the first of a call (by `index`) has `id` and `name`,
 * later ones more `arguments` text; joined, `arguments` is a JSON object's text. */
export interface ToolCallPart {
  index: number;
  id?: string;
  name?: string;
  arguments: string;
}

/** `tool_calls`: the model ended its turn with tool calls (protocol change, see CHANGELOG). */
export type DoneReason = "stop" | "length" | "tool_calls" | "cancelled" | "error";

export interface DoneFrame {
  type: "done";
  id: string;
  reason: DoneReason;
  usage: {
    prompt_tokens: number;
    completion_tokens: number;
    /** Of the completion tokens, the reasoning's (absent when 0). */
    reasoning_tokens?: number;
    /** Of the prompt tokens, those reused from the engine's prefix cache (absent from older servers). */
    cached_tokens?: number;
  };
  timings: {
    queued_ms: number;
    /** `null` when no text was sent. */
    ttft_ms: number | null;
    total_ms: number;
    tokens_per_s: number;
  };
  /** Present when `reason` is `"error"`. */
  error?: { code: string; message: string };
  /**
   * The upstream engine's own figures, when wsserver relays one that sends
   * them (llama-server's `timings`; `backend.kind = "openai"`).
   */
  upstream_timings?: {
    cache_n?: number;
    prompt_n?: number;
    prompt_ms?: number;
    prompt_per_token_ms?: number;
    prompt_per_second?: number;
    predicted_n?: number;
    predicted_ms?: number;
    predicted_per_token_ms?: number;
    predicted_per_second?: number;
    draft_n?: number;
    draft_n_accepted?: number;
  };
  /** The request's stop string that ended it (reason `stop`), when one did. */
  stop_sequence?: string;
  /** The model that answered. Absent from a server before it. */
  model?: string;
  /**
   * Set by the client (never by the server) on the `done` of a request
   * cancelled before it was sent.
   */
  local?: true;
}

/** The `upstream_*` codes come from the openai backend, only in a `done` with reason "error". */
export type ErrorCode =
  | "bad_json"
  | "bad_request"
  | "unknown_type"
  | "duplicate_id"
  | "unknown_id"
  | "busy"
  | "too_large"
  | "overloaded"
  | "rate_limited"
  | "stalled"
  | "internal"
  | "upstream_unreachable"
  | "upstream_rejected"
  | "upstream_failed"
  | "upstream_timeout"
  | "upstream_silent"
  | "upstream_bad_stream"
  | "upstream_truncated"
  | "upstream_unavailable"
  | "invalid_token"
  | "already_attached"
  | "seq_out_of_range"
  | "unsupported_option"
  | "invalid_tool_call"
  | "model_not_found"
  | "model_load_failed"
  | "bad_reference"
  | "pull_not_allowed"
  | "hub_not_found"
  | "hub_unauthorized"
  | "hub_unreachable"
  | "hub_error"
  | "download_too_large"
  | "disk_full"
  | "verification_failed";

export interface ErrorFrame {
  type: "error";
  id: string | null;
  code: ErrorCode;
  message: string;
}

export type ServerFrame =
  | HelloFrame
  | QueuedFrame
  | StartedFrame
  | DeltaFrame
  | ChoiceDoneFrame
  | DoneFrame
  | ErrorFrame
  | ResumedFrame
  | PullProgressFrame
  | PullDoneFrame
  | EmbedDoneFrame;

// ------------------------------------------------------------------ errors

/** Codes the client adds to the server's {@link ErrorCode}s. */
export type ClientErrorCode = "connection_lost" | "closed" | "protocol";

export declare class WsError extends Error {
  constructor(
    code: string,
    message: string,
    details?: { requestId?: string | null; frame?: ServerFrame | null },
  );
  /** `"WsError"`. */
  readonly name: string;
  /** A server {@link ErrorCode} or a {@link ClientErrorCode}. */
  readonly code: ErrorCode | ClientErrorCode | (string & {});
  readonly requestId: string | null;
  /** The frame that carried the error, if any. */
  readonly frame: ServerFrame | null;
}

// ------------------------------------------------------------------ tool calls

/**
 * One tool call of the model, joined from its parts so far (`id` and `name`
 * come with the first part, `arguments` text with every part).
 */
export declare class ToolCall {
  constructor(index: number, id: string, name: string, args?: string);
  /** The call's position among the turn's calls (0, 1, …). */
  index: number;
  /** What a `tool` message with the result names (`tool_call_id`). */
  id: string;
  /** The function called (one of the request's `tools`). */
  name: string;
  /** The arguments' JSON text, joined from the parts received. */
  arguments: string;
  /** The arguments as a JSON object, or `null` while they are not one. */
  readonly parsedArguments: Record<string, unknown> | null;
  /** Why the arguments are not a JSON object, or `null` if they are. */
  readonly argumentsError: string | null;
  /** The call as an assistant message's `tool_calls` entry. */
  toMessage(): ToolCallInput;
}

/** A stream's call as a page keeps it across a reload (`client.resume()`). */
export interface SavedToolCall {
  index: number;
  id: string;
  name: string;
  arguments: string;
}

// ------------------------------------------------------------------ events

type Unsubscribe = () => void;

declare class Emitter<Events> {
  /** Add a listener; returns a function that removes it. */
  on<K extends keyof Events>(type: K, listener: (detail: Events[K]) => void): Unsubscribe;
  off<K extends keyof Events>(type: K, listener: (detail: Events[K]) => void): void;
}

/**
 * - `connecting`: a socket is being opened (first time or a retry).
 * - `open`: the server's `hello` arrived; requests go out at once.
 * - `reconnecting`: waiting `delayMs` before the next attempt.
 * - `closed`: `close()` was called, reconnect is off, or attempts ran out.
 */
export type ConnectionState = "connecting" | "open" | "reconnecting" | "closed";

export interface StateEvent {
  state: ConnectionState;
  previous: ConnectionState;
  /** Failed attempts since the last successful connection. */
  attempt: number;
  /** With `reconnecting`: the wait before the next attempt. */
  delayMs: number | null;
  /** The close code of the socket that dropped, if any. */
  code: number | null;
  reason: string | null;
}

export interface ClientEvents {
  state: StateEvent;
  hello: HelloFrame;
  /** Every frame as received, before routing (for logs and tests). */
  frame: ServerFrame;
  /** An error not tied to a live request. */
  error: WsError;
  /** A new connection resumed these resumable requests of a lost one. */
  reconnect: { epoch: number; resumed: string[] };
}

export interface StreamEvents {
  /** `loading` while its model loads; `download` while it downloads first: how far. */
  queued: { position: number; loading?: true; download?: PullProgress };
  started: undefined;
  /** The text of each `delta` frame that has text, as it arrives. */
  delta: string;
  /** The reasoning of each `delta` frame that has some (before its text). */
  reasoning: string;
  /** A part of a tool call (after its frame's text): the call it joined, and the text it added. */
  toolCall: { call: ToolCall; arguments: string };
  /** One choice of a request for several (`n`) ended. */
  choiceDone: ChoiceDoneFrame;
  done: DoneFrame;
  error: WsError;
  /** The server accepted the resume: the text after `afterSeq` follows. */
  resumed: { afterSeq: number };
}

// ------------------------------------------------------------------ options

/**
 * The reconnect/resume policy (the Python clients' too; docs/protocol.md,
 * "Resuming a stream"). The defaults are {@link RECONNECT_DEFAULTS}.
 */
export interface ReconnectOptions {
  /** First retry delay. Default 100 ms. */
  initialDelayMs?: number;
  /** Cap of the delay. Default 1000 ms. */
  maxDelayMs?: number;
  /** Growth per failed attempt. Default 2. */
  factor?: number;
  /** Up to this fraction is taken off each delay at random. Default 0.25. */
  jitter?: number;
  /** Give up (state `closed`) after this many failed attempts. Default Infinity. */
  maxAttempts?: number;
  /**
   * A resumable request kept through a lost connection fails when the next
   * try to get it back (reconnecting, or asking again after `already_attached`)
   * would start later than this after the loss: with `connection_lost` or
   * `already_attached`. The connection goes on reconnecting. Default 30 000 ms,
   * the server's default `stream.resume_grace_s`.
   */
  resumeTimeoutMs?: number;
}

/** The policy's numbers: the default {@link ReconnectOptions}. */
export declare const RECONNECT_DEFAULTS: Readonly<Required<ReconnectOptions>>;

/**
 * The policy's decisions as plain functions (what the client calls; checked
 * against clients/reconnect-policy.json by the tests of both languages).
 */
export declare const reconnectPolicy: Readonly<{
  /** The error codes of a kept request given up. */
  gaveUp: Readonly<{ reconnecting: "connection_lost"; resuming: "already_attached" }>;
  /** The wait before try `attempt` (1, 2, …); `draw` in [0, 1) picks the jitter. */
  delayMs(options: Required<ReconnectOptions>, attempt: number, draw: number): number;
  /** The wait before try `attempt`, `elapsedMs` after the loss; `null`: give up. */
  waitMs(
    options: Required<ReconnectOptions>,
    attempt: number,
    elapsedMs: number,
    draw: number,
  ): number | null;
  /** Whether a live request is kept through a lost connection, to be resumed. */
  keepsOnLoss(resumable: boolean, reconnecting: boolean): boolean;
  /** The `resume` (or, if abandoned, `cancel`) frame of a kept request. */
  resumeFrame(request: {
    id: string;
    resumeToken: string | null;
    lastSeq: number;
    abandoned: boolean;
  }): Record<string, unknown>;
  /** Whether an `error` about a request is retried: `already_attached` to our `resume`. */
  retriesRefusal(code: string, resuming: boolean): boolean;
}>;

export interface ClientOptions {
  /**
   * Sent as the subprotocol `bearer.<token>` beside `wsserver.v1` (browsers
   * cannot set an Authorization header on a WebSocket). Must be an RFC 7230
   * token: hex or base64url.
   */
  token?: string;
  /** `true` (default) for the default backoff, `false` to never reconnect. */
  reconnect?: boolean | ReconnectOptions;
  /** Connect in the constructor (default). With `false`, call `connect()`. */
  connect?: boolean;
  /** A WebSocket implementation, where there is no global one. */
  WebSocket?: typeof WebSocket;
  /** Prefix of generated request IDs (default: random). */
  idPrefix?: string;
  /** Make every request resumable (a request's own `resumable` wins). */
  resumable?: boolean;
}

export interface RequestOptions {
  /** The request ID (default: generated). 1–64 of `[A-Za-z0-9_.:-]`. */
  id?: string;
  /** Aborting it cancels the request. */
  signal?: AbortSignal;
  onQueued?: (detail: { position: number }) => void;
  onStarted?: () => void;
  onDelta?: (text: string) => void;
  onReasoning?: (text: string) => void;
  onToolCall?: (detail: { call: ToolCall; arguments: string }) => void;
  onDone?: (frame: DoneFrame) => void;
  onError?: (error: WsError) => void;
}

// ------------------------------------------------------------------ classes

/**
 * - `pending`: waiting for the connection to open.
 * - `sent`: sent; no `queued` or `started` yet.
 * - `queued`, `running`: as the server reported.
 * - `cancelling`: cancelled by the caller; waiting for the server's `done`.
 * - `done`: the `done` frame arrived.
 * - `failed`: refused by the server, or the connection was lost or closed.
 */
export type StreamStatus =
  | "pending"
  | "sent"
  | "queued"
  | "running"
  | "cancelling"
  | "done"
  | "failed";

/**
 * One request. `for await (const text of stream)` yields its text (pieces that
 * arrived while the loop was busy are merged); leaving the loop early cancels
 * the request. Iteration throws a {@link WsError} if the request is refused,
 * ends with reason `error`, or its connection drops.
 */
export declare class GenerationStream
  extends Emitter<StreamEvents>
  implements AsyncIterable<string>
{
  /** Internal: streams are made by `client.generate()` and `client.restart()`. */
  constructor(client: WsClient, id: string, frame: Record<string, unknown>, input: GenerateParams);
  readonly id: string;
  /** The frame sent (or to be sent). */
  readonly frame: Record<string, unknown>;
  /** The full input, as a restart reuses it. */
  readonly input: GenerateParams;
  readonly status: StreamStatus;
  /** Queue position while `queued`, else `null`. */
  readonly position: number | null;
  /**
   * All text received before the request ended or was cancelled (a piece the
   * loop had not taken yet when it was cancelled is here, but not yielded).
   */
  readonly text: string;
  /** All reasoning received (a think block kept apart from `text`). */
  readonly reasoning: string;
  /** The model's tool calls, in order, joined from their parts so far. */
  readonly toolCalls: ToolCall[];
  /** A request for several choices (`n`): each choice's text by index (`text` has them all). */
  readonly choiceTexts: string[];
  /** A request for several choices: the `choice_done` of each ended choice. */
  readonly choiceEnds: ChoiceDoneFrame[];
  /** True after `done` or a failure. */
  readonly finished: boolean;
  /** True after `cancel()`, `restart()` or leaving the loop early. */
  readonly abandoned: boolean;
  /** A resumable request's token (from `started`), else `null`. Keep it secret. */
  resumeToken: string | null;
  /** The `seq` of the last delta received (-1: none). */
  readonly lastSeq: number;
  /** True while a lost connection would keep this request. */
  readonly resumable: boolean;
  /**
   * The server's `done` frame (any reason, including `cancelled` and
   * `error`). Rejects with a {@link WsError} when the request ends without
   * one: refused, connection lost, client closed.
   */
  readonly done: Promise<DoneFrame>;
  /** Cancel in-band; text stops at once; resolves with the `done` frame. */
  cancel(): Promise<DoneFrame>;
  /** `client.restart(this, overrides, options)`. */
  restart(overrides?: Partial<GenerateParams>, options?: RequestOptions): GenerationStream;
  /** Read to the end. */
  result(): Promise<{ text: string; reasoning: string; toolCalls: ToolCall[]; done: DoneFrame }>;
  /** The answer as the next request's assistant message (text and `tool_calls`; with calls, its `reasoning`). */
  message(): ChatMessage;
  [Symbol.asyncIterator](): AsyncIterator<string>;
}

export declare class WsClient extends Emitter<ClientEvents> {
  constructor(url: string | URL, options?: ClientOptions);
  readonly url: string;
  readonly state: ConnectionState;
  /** The current connection's `hello`, or `null`. */
  readonly hello: HelloFrame | null;
  /** Incremented for every socket the client opens. */
  readonly epoch: number;
  /** Whether requests are resumable unless they say otherwise. */
  resumable: boolean;
  /** Connect now, or retry at once while `reconnecting`. */
  connect(): void;
  /** Resolves with `hello` once open; rejects if the client closes first. */
  ready(): Promise<HelloFrame>;
  /** Close and stop reconnecting; live requests fail with code `closed`. */
  close(code?: number, reason?: string): void;
  /** A fresh request ID. */
  newId(): string;
  /** Start a request (sent now, or once the connection opens). */
  generate(params: GenerateParams, options?: RequestOptions): GenerationStream;
  /**
   * Regenerate `old` with `overrides`: an in-band `restart` on the same
   * connection, else a new `generate` with `old`'s remembered input.
   */
  restart(
    old: GenerationStream | string,
    overrides?: Partial<GenerateParams>,
    options?: RequestOptions,
  ): GenerationStream;
  /** Cancel by ID; `null` if no live request has that ID. */
  cancel(id: string): Promise<DoneFrame | null>;
  /**
   * Pick up a resumable request an earlier page or process started (after a
   * reload): the stream yields the text after `afterSeq`.
   */
  resume(
    saved: { id: string; resumeToken: string; afterSeq: number; toolCalls?: SavedToolCall[] },
    options?: RequestOptions,
  ): GenerationStream;
  /**
   * Download a model from the Hugging Face Hub onto the server (where
   * `hello.pull` is true); served once `done` resolves with `complete`.
   */
  pull(reference: string, options?: PullOptions): PullHandle;
  /** Each input's vector (docs/embeddings.md); rejects with a `WsError`. */
  embed(input: EmbedInput, options?: EmbedOptions): Promise<Embedding>;
}

// Without this, every top-level declaration of a .d.ts module is exported,
// `Emitter` included, which wsserver.js does not export.
export {};
