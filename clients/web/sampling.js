/**
 * The chat page's sampling settings: what the "Sampling" disclosure holds,
 * their ranges (docs/protocol.schema.json), the page's defaults, where they
 * are kept, and which of them a request carries.
 *
 * **Defaults.** The default model (gemma-3-270m, a base model without a chat
 * template) asked for a list in this page repeats the question or a line of
 * its answer until `max_tokens`: nothing in the protocol's defaults holds it
 * back (`repeat_penalty` 1 is off). The page asks for llama-server's `min_p`
 * 0.05 (cuts the long tail of unlikely tokens that derails a small model at
 * temperature 0.8) and a repetition penalty of 1.15 over the last 256 tokens:
 * 1.1 over llama.cpp's 64 (Ollama's default) lets a 270M model loop on a
 * question longer than the window, and much above 1.2 it starts avoiding the
 * words an answer needs ("the", newlines in a list). The penalty looks back
 * over the prompt too, so a repeated question is held back from the start.
 * (A quick check on that model, "Give me a list of five fruits." at
 * temperature 0.8, three seeds, 160 tokens: 5–9 repeated lines each with no
 * penalty, 0–3 at 1.1–1.15, none at 1.25.)
 *
 * **What a request carries** (`requestOptions`). Each option has the value
 * the server uses when it is left out (`server`), the value at which it
 * changes nothing (`neutral`, which every engine accepts) and the page's
 * default. The page leaves out a value equal to the server's; sends a
 * neutral one (so that `min_p` 0 means off, not the server's 0.05); leaves
 * out its own default when the server's `hello.honours` says the engine does
 * not honour the option (the fake engine has no penalties: the page keeps
 * working, and the disclosure says the option is not used); and sends any
 * other value the person chose, so that an engine that cannot honour it
 * refuses it with `unsupported_option`, which the answer shows — a choice is
 * never silently dropped. "Reset" restores the defaults.
 */

const KEY = "wsserver.sampling.v1";

/**
 * @typedef {{temperature: number, repeat_penalty: number, repeat_last_n: number, min_p: number, json: boolean}} Settings
 * @typedef {{min: number, max: number, integer?: boolean, server: number, neutral?: number}} Range
 */

/** The page's defaults (see the module comment for why). @type {Readonly<Settings>} */
export const DEFAULTS = Object.freeze({
  temperature: 0.8,
  repeat_penalty: 1.15,
  repeat_last_n: 256,
  min_p: 0.05,
  json: false,
});

/**
 * The protocol's ranges (within what the page offers: `temperature` goes to
 * 100 on the wire, 2 here), the server's default and the neutral value.
 * @type {Readonly<Record<"temperature" | "repeat_penalty" | "repeat_last_n" | "min_p", Range>>}
 */
export const RANGES = Object.freeze({
  temperature: { min: 0, max: 2, server: 0.8 },
  // > 0 on the wire; 0.01 is the smallest step the field offers.
  repeat_penalty: { min: 0.01, max: 10, server: 1, neutral: 1 },
  repeat_last_n: { min: -1, max: 2 ** 20, integer: true, server: 64 },
  min_p: { min: 0, max: 1, server: 0.05, neutral: 0 },
});

/** What `json: true` asks for: any JSON object (the fake engine honours it too). */
export const JSON_SCHEMA = Object.freeze({ type: "object" });

/**
 * `value` if it is a number within `name`'s range, else null.
 * @param {keyof typeof RANGES} name
 * @param {unknown} value
 */
export function valid(name, value) {
  const range = RANGES[name];
  const number = typeof value === "string" ? (value.trim() === "" ? Number.NaN : Number(value)) : value;
  if (typeof number !== "number" || !Number.isFinite(number)) return null;
  if (number < range.min || number > range.max) return null;
  if (range.integer && !Number.isInteger(number)) return null;
  return number;
}

/** The stored settings, each invalid or missing one at its default. @returns {Settings} */
export function loadSettings(storage = globalThis.localStorage) {
  /** @type {any} */
  let data = null;
  try {
    data = JSON.parse(storage.getItem(KEY) ?? "null");
  } catch {
    // Unreadable (or no storage at all): the defaults.
  }
  const settings = { ...DEFAULTS };
  for (const name of /** @type {(keyof typeof RANGES)[]} */ (Object.keys(RANGES))) {
    const value = valid(name, data?.[name]);
    if (value !== null) settings[name] = value;
  }
  if (typeof data?.json === "boolean") settings.json = data.json;
  return settings;
}

/** @param {Settings} settings */
export function saveSettings(settings, storage = globalThis.localStorage) {
  try {
    storage.setItem(KEY, JSON.stringify(settings));
  } catch {
    // Full or disabled: the settings last as long as the page.
  }
}

/**
 * The options to show as not used: the page's defaults this engine does not
 * honour (an empty list when `honours` is unknown).
 * @param {string[] | undefined} honours `hello.honours`
 * @returns {string[]}
 */
export function unhonoured(honours) {
  if (!Array.isArray(honours)) return [];
  return ["repeat_penalty", "min_p", "json_schema"].filter((name) => !honours.includes(name));
}

/**
 * The sampling fields of a `generate` or `restart` (see the module comment).
 * @param {Settings} settings
 * @param {string[] | undefined} honours `hello.honours`; undefined: not said
 * @returns {Record<string, unknown>}
 */
export function requestOptions(settings, honours) {
  /** @type {Record<string, unknown>} */
  const out = { temperature: settings.temperature };
  /** @param {"repeat_penalty" | "min_p"} name */
  const wanted = (name) => {
    const value = settings[name];
    const range = RANGES[name];
    if (value === range.server) return false;
    if (value === range.neutral) return true;
    const declined = Array.isArray(honours) && !honours.includes(name);
    return !(declined && value === DEFAULTS[name]);
  };
  if (wanted("repeat_penalty")) {
    out.repeat_penalty = settings.repeat_penalty;
    // The window matters only beside a penalty (a parameter alone asks for nothing).
    if (settings.repeat_last_n !== RANGES.repeat_last_n.server) out.repeat_last_n = settings.repeat_last_n;
  }
  if (wanted("min_p")) out.min_p = settings.min_p;
  if (settings.json) out.json_schema = JSON_SCHEMA;
  return out;
}
