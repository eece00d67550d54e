/**
 * Models by name on the page (docs/models.md): the notice a base model gets,
 * the "Get a model" dialog, and how a download reads while a request waits.
 *
 * A model without a chat template (`hello.models[].chat_template === false`,
 * like the bundled Gemma 3 270M) is a base model: asked "Hello! Who are
 * you?", it continues the text. The page says so above the conversation and
 * names the one command that serves a chat model instead — and, where the
 * server lets this page pull (`hello.pull`), offers the dialog: type a
 * reference, watch the download (a bar, size, rate, time left), cancel it;
 * once it is done the model is in the picker, chosen for this conversation.
 *
 * @module pulls
 */

/** @typedef {import("/wsserver.js").WsClient} WsClient */
/** @typedef {import("/wsserver.js").PullProgress} PullProgress */
/** @typedef {import("/wsserver.js").ModelInfo} ModelInfo */
/** @typedef {import("/wsserver.js").HelloFrame} HelloFrame */

/** A small instruction-tuned model to suggest (llama.cpp's own repository of it). */
export const CHAT_MODEL = "ggml-org/gemma-3-1b-it-GGUF";

const UNITS = ["B", "kB", "MB", "GB", "TB"];

/** @param {number} count bytes, as download tools show them (decimal units) */
export function humanBytes(count) {
  let value = count;
  for (const unit of UNITS) {
    if (Math.abs(value) < 1000 || unit === "TB") {
      return unit === "B" ? `${Math.round(value)} B` : `${value.toFixed(1)} ${unit}`;
    }
    value /= 1000;
  }
  return `${count} B`;
}

/** @param {number} seconds */
export function humanDuration(seconds) {
  const whole = Math.round(seconds);
  if (whole < 60) return `${whole} s`;
  const minutes = Math.floor(whole / 60);
  if (minutes < 60) return `${minutes} min ${String(whole % 60).padStart(2, "0")} s`;
  return `${Math.floor(minutes / 60)} h ${String(minutes % 60).padStart(2, "0")} min`;
}

const STATUS = {
  resolving: "Asking the Hub",
  checking: "Checking what is already here",
  downloading: "Downloading",
  verifying: "Verifying",
  done: "Done",
};

/**
 * One line about a download: what, how far, how fast, how long still.
 *
 * @param {PullProgress} progress
 */
export function describeProgress(progress) {
  const parts = [STATUS[progress.status] ?? progress.status];
  if (progress.file) parts[0] += ` ${progress.file.split("/").pop()}`;
  if (progress.total > 0) {
    const percent = Math.floor((100 * progress.completed) / progress.total);
    parts.push(`${percent}%`, `${humanBytes(progress.completed)} of ${humanBytes(progress.total)}`);
  }
  if (typeof progress.rate === "number") parts.push(`${humanBytes(progress.rate)}/s`);
  if (typeof progress.eta_s === "number") parts.push(`${humanDuration(progress.eta_s)} left`);
  return parts.join(" · ");
}

/**
 * The page's models-by-name parts.
 *
 * @param {object} options
 * @param {WsClient} options.client
 * @param {() => string} options.currentModel the model the conversation talks to
 * @param {(model: ModelInfo) => void} options.onPulled a pulled model is served
 */
export function setupPulls({ client, currentModel, onPulled }) {
  const $ = (/** @type {string} */ id) => /** @type {HTMLElement} */ (document.getElementById(id));
  const ui = {
    notice: $("base-model"),
    noticeName: $("base-model-name"),
    noticeGet: /** @type {HTMLButtonElement} */ ($("base-model-get")),
    open: /** @type {HTMLButtonElement} */ ($("get-model")),
    dialog: /** @type {HTMLDialogElement} */ ($("pull-dialog")),
    form: /** @type {HTMLFormElement} */ ($("pull-form")),
    reference: /** @type {HTMLInputElement} */ ($("pull-reference")),
    start: /** @type {HTMLButtonElement} */ ($("pull-start")),
    cancel: /** @type {HTMLButtonElement} */ ($("pull-cancel")),
    close: /** @type {HTMLButtonElement} */ ($("pull-close")),
    bar: /** @type {HTMLProgressElement} */ ($("pull-bar")),
    status: $("pull-status"),
    keep: $("pull-keep"),
  };
  /** @type {import("/wsserver.js").PullHandle | null} */
  let running = null;

  function allowed() {
    return client.hello?.pull === true;
  }

  /** Show or hide the base-model notice for the conversation's model. */
  function update() {
    const hello = client.hello;
    ui.open.hidden = !allowed();
    const name = currentModel();
    const info = hello?.models?.find((m) => m.name === name);
    ui.notice.hidden = !(info && info.chat_template === false);
    ui.noticeName.textContent = name;
    ui.noticeGet.hidden = !allowed();
  }

  function openDialog() {
    if (!ui.dialog.open) ui.dialog.showModal();
    if (!running) ui.reference.focus();
  }

  /** @param {boolean} busy */
  function busy(busy) {
    ui.start.disabled = busy;
    ui.reference.disabled = busy;
    ui.cancel.hidden = !busy;
    ui.bar.hidden = !busy && ui.bar.value === 0;
  }

  /** @param {PullProgress} progress */
  function show(progress) {
    if (progress.total > 0) {
      ui.bar.max = progress.total;
      ui.bar.value = progress.completed;
    } else {
      ui.bar.removeAttribute("value"); // indeterminate while the Hub is asked
    }
    ui.status.textContent = describeProgress(progress);
  }

  async function start() {
    const reference = ui.reference.value.trim();
    if (!reference || running) return;
    ui.keep.hidden = true;
    ui.bar.value = 0;
    ui.bar.hidden = false;
    ui.status.textContent = `Pulling ${reference}…`;
    busy(true);
    const pull = client.pull(reference, { onProgress: show });
    running = pull;
    try {
      const done = await pull.done;
      if (done.reason === "complete" && done.model) {
        ui.bar.max = 1;
        ui.bar.value = 1;
        ui.status.textContent =
          `Ready: ${done.model.name} is in the model picker` +
          (done.downloaded ? ` (${humanBytes(done.downloaded)} downloaded).` : " (it was already here).");
        ui.keep.hidden = false;
        ui.keep.textContent =
          `To serve it after a restart too, add to the server's configuration: ` +
          `model = "hf:${reference.replace(/^hf:/, "")}"`;
        onPulled(done.model);
      } else if (done.reason === "cancelled") {
        ui.status.textContent = "Cancelled. What was downloaded is kept: getting it again resumes.";
      } else {
        ui.status.textContent = `Failed: ${done.error?.message ?? "unknown error"}`;
      }
    } catch (error) {
      ui.status.textContent = `Refused: ${error instanceof Error ? error.message : String(error)}`;
    } finally {
      running = null;
      busy(false);
      update();
    }
  }

  ui.reference.value = CHAT_MODEL;
  ui.open.addEventListener("click", openDialog);
  ui.noticeGet.addEventListener("click", openDialog);
  ui.form.addEventListener("submit", (event) => {
    event.preventDefault();
    void start();
  });
  ui.cancel.addEventListener("click", () => {
    void running?.cancel();
  });
  ui.close.addEventListener("click", () => ui.dialog.close());
  client.on("hello", update);
  busy(false);
  update();
  return { update };
}
