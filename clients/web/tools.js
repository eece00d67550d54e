/**
 * The chat page's tools and what the model does with them: the "Tools"
 * disclosure's setting, and the DOM of an answer's reasoning and tool calls.
 *
 * **Tools.** The person pastes OpenAI's function tools (a JSON list) into the
 * disclosure; every request carries them as `tools` while the text is a valid
 * list, and none while it is empty. Text that is not a valid list is kept
 * (so that it can be fixed) and said to be invalid: then no tools are sent,
 * and the note says so — never a half-read list. The page cannot run a
 * function: a call is shown, and the conversation goes on with the next
 * message.
 *
 * **Reasoning** (a think block the server keeps apart from the answer) is
 * shown in a collapsed "Thinking" disclosure above the answer, rendered like
 * the answer (markdown, sanitized: markdown.js) and growing live while it
 * streams, open or closed.
 *
 * **Tool calls** are cards below the answer: the function's name, its
 * arguments pretty-printed, and a mark when the arguments are not a JSON
 * object. Everything from the model is set as text, never as markup.
 */

const KEY = "wsserver.tools.v1";

/**
 * @typedef {{type: "function", function: {name: string, description?: string, parameters?: object}}} Tool
 * @typedef {{index: number, id: string, name: string, arguments: string}} StoredCall
 */

/**
 * The tools in `text`, or why there are none.
 * @param {string} text the disclosure's text
 * @returns {{tools: Tool[] | null, error: string | null}} `tools` null: none to send
 */
export function parseTools(text) {
  if (!text.trim()) return { tools: null, error: null };
  let value;
  try {
    value = JSON.parse(text);
  } catch (error) {
    return { tools: null, error: `not JSON (${/** @type {Error} */ (error).message})` };
  }
  if (!Array.isArray(value)) return { tools: null, error: "not a list of tools" };
  for (const [i, tool] of value.entries()) {
    const name = tool?.function?.name;
    if (tool?.type !== "function" || typeof name !== "string" || !name) {
      return { tools: null, error: `tool ${i + 1} is not {"type": "function", "function": {"name": …}}` };
    }
  }
  return value.length > 0 ? { tools: value, error: null } : { tools: null, error: null };
}

/** The disclosure's stored text ("" if none). */
export function loadTools(storage = globalThis.localStorage) {
  try {
    return storage.getItem(KEY) ?? "";
  } catch {
    return "";
  }
}

/** @param {string} text */
export function saveTools(text, storage = globalThis.localStorage) {
  try {
    if (text) storage.setItem(KEY, text);
    else storage.removeItem(KEY);
  } catch {
    // Full or disabled: the tools last as long as the page.
  }
}

/**
 * An answer's "Thinking" disclosure, before its text; collapsed.
 * @param {HTMLElement} article the answer's article
 * @returns {{details: HTMLDetailsElement, body: HTMLElement}}
 */
export function thinkingBlock(article) {
  const existing = /** @type {HTMLDetailsElement | null} */ (article.querySelector("details.thinking"));
  if (existing !== null) {
    return { details: existing, body: /** @type {HTMLElement} */ (existing.querySelector(".thinking-text")) };
  }
  const details = document.createElement("details");
  details.className = "thinking";
  const summary = document.createElement("summary");
  const body = document.createElement("div");
  body.className = "thinking-text";
  details.append(summary, body);
  article.querySelector(".text")?.before(details);
  setThinking(details, false);
  return { details, body };
}

/**
 * Say whether the model is still thinking.
 * @param {HTMLDetailsElement} details
 * @param {boolean} streaming
 */
export function setThinking(details, streaming) {
  details.dataset.state = streaming ? "streaming" : "done";
  const summary = /** @type {HTMLElement} */ (details.querySelector("summary"));
  summary.textContent = streaming ? "Thinking…" : "Thoughts";
}

/**
 * Show an answer's tool calls as cards (replacing the ones shown), below its text.
 * @param {HTMLElement} article
 * @param {StoredCall[]} calls
 * @param {boolean} complete the answer has ended: a call that does not parse is marked
 */
export function showToolCalls(article, calls, complete) {
  let list = /** @type {HTMLElement | null} */ (article.querySelector(".tool-calls"));
  if (calls.length === 0) {
    list?.remove();
    return;
  }
  if (list === null) {
    list = document.createElement("div");
    list.className = "tool-calls";
    article.querySelector(".text")?.after(list);
  }
  list.replaceChildren(...calls.map((call) => toolCallCard(call, complete)));
}

/**
 * @param {StoredCall} call
 * @param {boolean} complete
 */
function toolCallCard(call, complete) {
  const card = document.createElement("section");
  card.className = "tool-call";
  card.setAttribute("aria-label", `Tool call: ${call.name}`);
  const head = document.createElement("header");
  const label = document.createElement("span");
  label.className = "tool-label";
  label.textContent = "Calls";
  const name = document.createElement("code");
  name.className = "tool-name";
  name.textContent = call.name;
  const id = document.createElement("span");
  id.className = "tool-id";
  id.textContent = call.id;
  head.append(label, name, id);
  const { pretty, error } = prettyArguments(call.arguments);
  const pre = document.createElement("pre");
  pre.className = "tool-arguments";
  const code = document.createElement("code");
  code.textContent = pretty;
  pre.append(code);
  card.append(head, pre);
  card.dataset.state = error === null ? "ok" : complete ? "invalid" : "streaming";
  if (error !== null && complete) {
    const mark = document.createElement("p");
    mark.className = "tool-error";
    mark.setAttribute("role", "note");
    mark.textContent = `⚠ ${error}`;
    card.append(mark);
  }
  return card;
}

/**
 * The arguments pretty-printed if they are a JSON object, else as they came
 * and why they are not.
 * @param {string} text
 * @returns {{pretty: string, error: string | null}}
 */
export function prettyArguments(text) {
  let value;
  try {
    value = JSON.parse(text);
  } catch (error) {
    return { pretty: text, error: `The arguments are not valid JSON: ${/** @type {Error} */ (error).message}` };
  }
  if (value === null || typeof value !== "object" || Array.isArray(value)) {
    return { pretty: text, error: "The arguments are JSON but not an object" };
  }
  return { pretty: JSON.stringify(value, null, 2), error: null };
}

/**
 * A stored call list, or [] if `value` is not one (storage is input too).
 * @param {unknown} value
 * @returns {StoredCall[]}
 */
export function storedCalls(value) {
  if (!Array.isArray(value)) return [];
  return value.filter(
    (c) =>
      typeof c?.index === "number" && typeof c.id === "string" && typeof c.name === "string" && typeof c.arguments === "string",
  );
}
