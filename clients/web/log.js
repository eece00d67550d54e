/**
 * The DOM of the conversation log and of the list of conversations: building
 * blocks for app.js, with no state of their own.
 */

/**
 * A message's article, appended to `log`. An assistant's has a footer with
 * its statistics (`.meta`) and a Copy button; its text is rendered by a view.
 * @param {HTMLElement} log
 * @param {"user" | "assistant"} role
 * @param {string} text a user message's text (shown as typed)
 * @returns {HTMLElement}
 */
export function appendMessage(log, role, text) {
  const article = document.createElement("article");
  article.className = `message ${role}`;
  const label = document.createElement("p");
  label.className = "role";
  label.textContent = role === "user" ? "You" : "Model";
  const body = document.createElement("div");
  body.className = "text";
  article.append(label, body);
  if (role === "user") {
    body.textContent = text;
  } else {
    const footer = document.createElement("div");
    footer.className = "footer";
    const meta = document.createElement("p");
    meta.className = "meta";
    footer.append(meta, button("copy-answer quiet", "Copy", "Copy the answer as markdown"));
    article.append(footer);
  }
  log.append(article);
  return article;
}

/**
 * Only the last user message has an Edit button.
 * @param {HTMLElement} log
 */
export function markLastUser(log) {
  for (const edit of log.querySelectorAll(".edit")) edit.remove();
  const users = log.querySelectorAll(".message.user");
  users[users.length - 1]?.append(button("edit quiet", "Edit", "Edit this message and send it again"));
}

/**
 * The list of conversations, newest first; the current one marked.
 * @param {HTMLElement} list
 * @param {import("/store.js").Conversation[]} conversations
 * @param {string | null} currentId
 */
export function showHistory(list, conversations, currentId) {
  const items = conversations
    .filter((c) => c.messages.length > 0)
    .map((c) => {
      const item = document.createElement("li");
      item.dataset.id = c.id;
      if (c.id === currentId) item.setAttribute("aria-current", "true");
      const title = c.title || "Untitled";
      const remove = button("delete-chat quiet", "×", "");
      remove.setAttribute("aria-label", `Delete “${title}”`);
      item.append(button("open-chat", title, ""), remove);
      return item;
    });
  list.replaceChildren(...items);
}

/**
 * Copy to the clipboard, and say so on the button for a moment.
 * @param {string} text
 * @param {HTMLButtonElement} target
 */
export async function copy(text, target) {
  try {
    await navigator.clipboard.writeText(text);
    target.textContent = "Copied";
  } catch {
    target.textContent = "Copy failed";
  }
  setTimeout(() => {
    target.textContent = "Copy";
  }, 1500);
}

/**
 * @param {string} className
 * @param {string} text
 * @param {string} title
 */
function button(className, text, title) {
  const element = document.createElement("button");
  element.type = "button";
  element.className = className;
  element.textContent = text;
  if (title) element.title = title;
  return element;
}
