/**
 * Images in the composer: picked (the "Image" button), pasted or dropped,
 * shown as thumbnails until sent, then shown in the user's message and sent
 * with the conversation (docs/images.md; the JS client uploads them in binary
 * frames: docs/protocol.md, "Images").
 *
 * An image is kept as a `data:` URL: in the message, so that the stored
 * conversation (localStorage, about 5 MB per origin: store.js) holds it and
 * every later turn sends it again — the model reads the whole conversation
 * each turn. Hence the page's limit, **2 MiB an image** (MAX_IMAGE_BYTES),
 * and PNG, JPEG, GIF or BMP only (what the server's decoder reads); anything
 * else is refused here with a note, before the server sees it.
 *
 * A model that says it reads no images (`hello.models`' `input_modalities`
 * without "image") takes none: the page hides the Image button and a paste
 * or drop is refused with a note (`refusal`); a model not loaded yet does not
 * say, and the server refuses then if it must.
 */

/** The largest image the page takes (it is stored with the conversation). */
export const MAX_IMAGE_BYTES = 2 << 20;
/** What the server reads (docs/images.md, "Limits and refusals"). */
export const IMAGE_TYPES = Object.freeze(["image/png", "image/jpeg", "image/gif", "image/bmp"]);

export class Attachments {
  /**
   * @param {HTMLElement} list where the thumbnails go
   * @param {HTMLElement} note where a refused file is explained
   * @param {() => void} changed called when the images change
   */
  constructor(list, note, changed) {
    this.list = list;
    this.note = note;
    this.changed = changed;
    /** @type {string[]} data URLs, in order */
    this.images = [];
    /** Reads not finished yet. */
    this.reading = 0;
    /** Why the current model takes no images ("": it may). */
    this.refusal = "";
  }

  /**
   * The current model changed: say why it takes no images (or "" if it may).
   * Images already in the composer stay (another model may take them), with the note.
   * @param {string} refusal
   */
  refuse(refusal) {
    const said = this.refusal;
    this.refusal = refusal;
    if (refusal && this.images.length > 0) this.say(refusal);
    else if (said && this.note.textContent === said) this.say("");
    this.changed();
  }

  /** @param {string} text a note under the composer ("": none) */
  say(text) {
    this.note.textContent = text;
    this.note.hidden = !text;
  }

  get size() {
    return this.images.length;
  }

  /**
   * Take files (a pick, a paste, a drop): the images among them are read.
   * @param {Iterable<File | Blob>} files
   * @returns {Promise<void>}
   */
  async add(files) {
    if (this.refusal) {
      this.say(this.refusal);
      return;
    }
    /** @type {string[]} */
    const refused = [];
    const reads = [];
    for (const file of files) {
      const name = "name" in file && file.name ? file.name : "the image";
      if (!IMAGE_TYPES.includes(file.type)) refused.push(`${name}: not a PNG, JPEG, GIF or BMP`);
      else if (file.size > MAX_IMAGE_BYTES) refused.push(`${name}: over ${MAX_IMAGE_BYTES >> 20} MiB`);
      else reads.push(readAsDataUrl(file));
    }
    this.say(refused.join("; "));
    this.reading += reads.length;
    this.changed();
    try {
      for (const url of await Promise.all(reads)) this.images.push(url);
    } finally {
      this.reading -= reads.length;
      this.render();
    }
  }

  /** The images to send, emptying the composer's list. */
  take() {
    const images = this.images;
    this.images = [];
    this.note.hidden = true;
    this.render();
    return images;
  }

  render() {
    this.list.replaceChildren(
      ...this.images.map((url, index) => {
        const item = document.createElement("li");
        const remove = document.createElement("button");
        remove.type = "button";
        remove.className = "remove-image quiet";
        remove.textContent = "×";
        remove.title = "Remove this image";
        remove.addEventListener("click", () => {
          this.images.splice(index, 1);
          this.render();
        });
        item.append(thumbnail(url, `Image ${index + 1} to send`), remove);
        return item;
      }),
    );
    this.list.hidden = this.images.length === 0;
    this.changed();
  }
}

/**
 * The image files among a paste's or a drop's items.
 * @param {DataTransfer | null} data
 * @returns {File[]}
 */
export function imageFiles(data) {
  return Array.from(data?.files ?? []).filter((file) => file.type.startsWith("image/"));
}

/**
 * A message's images, as thumbnails above its text.
 * @param {HTMLElement} article
 * @param {string[] | undefined} images data URLs
 */
export function showImages(article, images) {
  if (!images?.length) return;
  const row = document.createElement("div");
  row.className = "images";
  row.append(...images.map((url, index) => thumbnail(url, `Image ${index + 1}`)));
  article.querySelector(".text")?.before(row);
}

/**
 * A data URL's bytes (what the JS client uploads).
 * @param {string} url
 * @returns {Uint8Array}
 */
export function dataUrlBytes(url) {
  const text = atob(url.slice(url.indexOf(",") + 1));
  const bytes = new Uint8Array(text.length);
  for (let i = 0; i < text.length; i++) bytes[i] = text.charCodeAt(i);
  return bytes;
}

/**
 * @param {string} url
 * @param {string} alt
 */
function thumbnail(url, alt) {
  const image = document.createElement("img");
  image.className = "thumbnail";
  image.src = url;
  image.alt = alt;
  return image;
}

/**
 * @param {Blob} file
 * @returns {Promise<string>}
 */
function readAsDataUrl(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(String(reader.result));
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}
