/**
 * Model output as markdown, rendered incrementally and sanitized.
 *
 * Model output is untrusted. It is parsed by marked (GFM: headings, lists,
 * emphasis, links, code, tables) with raw HTML turned into visible text, and
 * the resulting HTML goes through DOMPurify (an allow-list of tags and
 * attributes; links only to http:, https: and mailto:) before it reaches the
 * DOM. Both libraries are vendored in ./vendor/ (see its README.md).
 *
 * Incremental: an answer is a list of *finished* blocks and one *open* block
 * (the last one, which more text may still change). Each frame lexes only
 * the text from the start of the open block on; blocks the lexer has closed
 * (another block follows them) are rendered once, appended, and never touched
 * again; only the open block is re-rendered. So a frame's cost depends on the
 * open block and the new text, not on the length of the answer. Two kinds of
 * open block can grow without bound, and get special care:
 *
 * - a code block (an unclosed fence shows as code while it streams): new code
 *   is appended to the element as text instead of re-rendering it;
 * - a paragraph: past PARAGRAPH_CUT characters its start is rendered once
 *   into the paragraph element and kept, and only the rest is re-rendered
 *   (emphasis or a link that spans the cut is the one thing that can differ
 *   from a render of the whole paragraph).
 *
 * Any other open block (a long list or table) is re-rendered less often when
 * re-rendering it gets expensive, so rendering never takes most of a frame.
 *
 * Known limits: reference-style link definitions apply only within the open
 * part of the text, and a block is judged finished by the lexer's view of the
 * text so far (CommonMark lets very few constructs reach back across a
 * block that has been followed by another).
 */

import { Marked } from "/vendor/marked.esm.js";
import DOMPurify from "/vendor/purify.es.mjs";

/** A paragraph longer than this keeps its start and re-renders only the rest. */
const PARAGRAPH_CUT = 3000;
/** What stays re-rendered of a long paragraph after a cut, at least. */
const PARAGRAPH_KEEP_OPEN = 500;
/** Re-rendering the open block may take at most this share of the time. */
const RENDER_DUTY = 0.25;

const markdown = new Marked({ gfm: true, breaks: false });
markdown.use({
  renderer: {
    // Raw HTML in model output is shown as the text it is, never as markup.
    html: (token) => escapeHtml(token.text),
    // Images would load from anywhere (and the page's CSP blocks them): link them.
    image: (token) => `<a href="${escapeHtml(token.href)}">${escapeHtml(token.text || token.href)}</a>`,
  },
});

const ALLOWED_TAGS = [
  "a", "blockquote", "br", "code", "del", "em", "h1", "h2", "h3", "h4", "h5", "h6", "hr",
  "input", "li", "ol", "p", "pre", "strong", "table", "tbody", "td", "th", "thead", "tr", "ul",
];
const PURIFY = {
  ALLOWED_TAGS,
  ALLOWED_ATTR: ["href", "title", "class", "align", "start", "type", "checked", "disabled"],
  ALLOWED_URI_REGEXP: /^(?:https?:|mailto:)/i,
  RETURN_DOM_FRAGMENT: true,
};

DOMPurify.addHook("afterSanitizeAttributes", (node) => {
  if (node.tagName === "A") {
    if (node.hasAttribute("href")) {
      node.setAttribute("target", "_blank");
      node.setAttribute("rel", "noopener noreferrer nofollow");
    }
  } else if (node.tagName === "INPUT") {
    // Task-list checkboxes only.
    if (node.getAttribute("type") !== "checkbox") node.remove();
    else node.setAttribute("disabled", "");
  } else if (node.hasAttribute("class") && !/^language-[\w+#.-]+$/.test(node.getAttribute("class") ?? "")) {
    node.removeAttribute("class");
  }
});
DOMPurify.addHook("uponSanitizeAttribute", (_node, data) => {
  // target and rel are set by the hook above, never taken from the input.
  if (data.attrName === "target" || data.attrName === "rel") data.keepAttr = false;
});

/** @param {string} text */
function escapeHtml(text) {
  return text.replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`);
}

/**
 * Tokens → sanitized DOM, with code blocks dressed (language, copy button).
 * @param {any[]} tokens
 * @returns {DocumentFragment}
 */
function renderTokens(tokens) {
  const fragment = /** @type {DocumentFragment} */ (DOMPurify.sanitize(markdown.parser(tokens), PURIFY));
  for (const code of fragment.querySelectorAll("pre > code")) dressCode(/** @type {HTMLElement} */ (code));
  // marked puts a newline after each block; between blocks it is no content.
  for (const node of [...fragment.childNodes]) {
    if (node.nodeType === Node.TEXT_NODE && !node.textContent?.trim()) node.remove();
  }
  return fragment;
}

/**
 * Inline tokens (a paragraph's content), or inline markdown → sanitized DOM.
 * @param {any[] | string} tokens
 */
function renderInline(tokens) {
  const html = typeof tokens === "string" ? markdown.parseInline(tokens) : markdown.Parser.parseInline(tokens, markdown.defaults);
  return /** @type {DocumentFragment} */ (DOMPurify.sanitize(/** @type {string} */ (html), PURIFY));
}

/**
 * Wraps <pre><code> in a figure with a header: the language and a copy button.
 * @param {HTMLElement} code
 */
function dressCode(code) {
  const pre = /** @type {HTMLElement} */ (code.parentElement);
  const language = /^language-(.+)$/.exec(code.className)?.[1] ?? "";
  // marked ends a block's code with a newline; the copied code should not.
  const last = code.lastChild;
  if (last?.nodeType === Node.TEXT_NODE && last.textContent?.endsWith("\n")) {
    last.textContent = last.textContent.slice(0, -1);
  }
  const figure = document.createElement("figure");
  figure.className = "code";
  const head = document.createElement("figcaption");
  const label = document.createElement("span");
  label.className = "lang";
  label.textContent = language || "code";
  const copy = document.createElement("button");
  copy.type = "button";
  copy.className = "copy";
  copy.textContent = "Copy";
  copy.setAttribute("aria-label", `Copy ${language || "code"}`);
  head.append(label, copy);
  pre.replaceWith(figure);
  figure.append(head, pre);
}

/** An answer rendered as markdown into one container, text appended as it streams. */
export class MarkdownView {
  /** @param {HTMLElement} container */
  constructor(container) {
    this.container = container;
    container.classList.add("markdown");
    container.replaceChildren();
    /** The whole answer's source. */
    this.source = "";
    /** Characters of `source` already rendered for good. */
    this.committed = 0;
    /** Where the open block is rendered. */
    this.open = this.newBlock();
    /** The open block's code element while it is a code block. @type {{code: HTMLElement, lang: string, text: string} | null} */
    this.openCode = null;
    /** The paragraph being continued after a cut, and the nodes of its open part. @type {{p: HTMLElement, rest: ChildNode[]} | null} */
    this.paragraph = null;
    this.dirty = false;
    this.skipUntil = 0;
  }

  newBlock() {
    const block = document.createElement("div");
    block.className = "block";
    this.container.append(block);
    return block;
  }

  /** @param {string} text */
  append(text) {
    if (!text) return;
    // marked reads \r\n as \n; the offsets below must agree with its tokens.
    this.source += text.replace(/\r\n?/g, "\n");
    this.dirty = true;
  }

  /**
   * Bring the DOM up to date with the source: once per animation frame.
   * @param {boolean} [final] the answer is complete: everything is finished
   */
  render(final = false) {
    if (!this.dirty && !final) return;
    const now = performance.now();
    if (!final && now < this.skipUntil) return; // an expensive open block: not every frame
    this.dirty = false;
    const tail = this.source.slice(this.committed);
    const tokens = markdown.lexer(tail);
    // Blocks before the last one are finished (all of them at the end).
    let finished = final ? tokens.length : lastContent(tokens);
    let offset = 0;
    for (let i = 0; i < finished; i++) {
      // Commit only what provably is a prefix of the source.
      if (!tail.startsWith(tokens[i].raw, offset)) {
        finished = i;
        break;
      }
      offset += tokens[i].raw.length;
    }
    let start = 0;
    if (this.paragraph !== null && finished > 0) {
      // The long paragraph ended: its last part is rendered for good.
      const token = tokens[0];
      this.setRest(token.tokens ? renderInline(token.tokens) : renderTokens([token]));
      this.paragraph = null;
      this.open = this.newBlock();
      start = 1;
    }
    if (finished > start) {
      this.open.replaceChildren(renderTokens(tokens.slice(start, finished)));
      this.open = this.newBlock();
      this.openCode = null;
    }
    this.committed += offset;
    if (!final) this.renderOpen(tokens.slice(finished));
    else if (this.open.childNodes.length === 0) this.open.remove();
    const took = performance.now() - now;
    if (took > 4) this.skipUntil = now + took / RENDER_DUTY;
  }

  /** @param {any[]} tokens the open block (and any space after it) */
  renderOpen(tokens) {
    const token = tokens[0];
    if (token === undefined) {
      if (this.paragraph === null) this.open.replaceChildren();
      return;
    }
    if (this.paragraph !== null) {
      this.setRest(token.tokens ? renderInline(token.tokens) : renderTokens(tokens));
      this.maybeCut(token);
      return;
    }
    if (token.type === "code" && this.openCode !== null && this.openCode.lang === (token.lang ?? "")) {
      const known = this.openCode.text;
      if (token.text.startsWith(known)) {
        if (token.text.length > known.length) this.openCode.code.append(token.text.slice(known.length));
        this.openCode.text = token.text;
        return;
      }
    }
    this.open.replaceChildren(renderTokens(tokens));
    this.openCode = null;
    if (token.type === "code") {
      const code = /** @type {HTMLElement | null} */ (this.open.querySelector("pre > code"));
      if (code !== null) this.openCode = { code, lang: token.lang ?? "", text: code.textContent ?? "" };
    }
    this.maybeCut(token);
  }

  /**
   * A long open paragraph: render its start for good, keep re-rendering the rest.
   * @param {any} token
   */
  maybeCut(token) {
    if (token.type !== "paragraph" || token.raw.length < PARAGRAPH_CUT) return;
    const raw = token.raw;
    // Cut after a space followed by a letter: the rest then starts a line with
    // a letter, which no block construct does, so it lexes as the same paragraph.
    const limit = raw.length - PARAGRAPH_KEEP_OPEN;
    let cut = -1;
    for (const match of raw.slice(0, limit).matchAll(/ (?=\p{L})/gu)) cut = match.index + 1;
    if (cut <= 0) return;
    if (this.paragraph === null) {
      const p = document.createElement("p");
      this.open.replaceChildren(p);
      this.paragraph = { p, rest: [] };
    }
    this.setRest(renderInline(raw.slice(0, cut)));
    this.paragraph.rest = []; // the head stays for good
    this.setRest(renderInline(raw.slice(cut)));
    this.committed += cut;
  }

  /**
   * Replace the open part of a continued paragraph.
   * @param {DocumentFragment} fragment
   */
  setRest(fragment) {
    const paragraph = /** @type {{p: HTMLElement, rest: ChildNode[]}} */ (this.paragraph);
    for (const node of paragraph.rest) node.remove();
    paragraph.rest = [...fragment.childNodes];
    paragraph.p.append(fragment);
  }

  /** The answer is complete (or stopped): render everything as finished. */
  finish() {
    this.render(true);
  }
}

/**
 * Index of the last token that is not blank space: the open block. Everything
 * before it is finished. @param {any[]} tokens
 */
function lastContent(tokens) {
  for (let i = tokens.length - 1; i >= 0; i--) if (tokens[i].type !== "space") return i;
  return 0;
}

/**
 * For comparison (`?render=plain`): the answer as plain text, appended once
 * per frame into blocks of about BLOCK_CHARS characters.
 */
export class PlainView {
  /** @param {HTMLElement} container */
  constructor(container) {
    this.container = container;
    container.classList.add("plain");
    container.replaceChildren();
    this.source = "";
    this.pending = "";
    /** @type {HTMLElement | null} */
    this.block = null;
    this.blockChars = 0;
  }

  /** @param {string} text */
  append(text) {
    this.source += text;
    this.pending += text;
  }

  render() {
    let text = this.pending;
    if (!text) return;
    this.pending = "";
    if (this.blockChars >= 2000) {
      let cut = text.lastIndexOf("\n") + 1;
      if (cut === 0 && this.blockChars >= 6000) cut = text.lastIndexOf(" ") + 1 || text.length;
      if (cut > 0) {
        this.appendToBlock(text.slice(0, cut));
        text = text.slice(cut);
        this.block = null;
      }
    }
    if (text) this.appendToBlock(text);
  }

  /** @param {string} text */
  appendToBlock(text) {
    if (this.block === null) {
      this.block = document.createElement("div");
      this.block.className = "block";
      this.blockChars = 0;
      this.container.append(this.block);
    }
    this.block.append(text);
    this.blockChars += text.length;
  }

  finish() {
    this.render();
  }
}
