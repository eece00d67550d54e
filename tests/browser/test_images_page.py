"""The chat page's images (issue 39): pick, paste or drop an image; a thumbnail
in the composer and in the message; sent with the conversation (uploaded by
the JS client in binary frames) and kept in it across a reload.

The server serves the tiny vision model (a tiny llama and a tiny LLaVA
projector: tests/tiny_mmproj.py) as "seer"; the page's answer is compared
with OpenAI's chat API's for the same image and prompt.
"""

from __future__ import annotations

import base64
import json
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from wsserver.aio import web

from .chat import expect

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from tiny_gguf import write_tiny_gguf  # noqa: E402
from tiny_images import gradient_png, solid_png  # noqa: E402
from tiny_mmproj import write_tiny_mmproj  # noqa: E402

pytestmark = pytest.mark.browser
pytest.importorskip("llama_cpp.mtmd_cpp")

RED = solid_png((255, 0, 0))
GRADIENT = gradient_png()

#: Records the JSON frames the page sends (binary uploads are counted).
RECORD_FRAMES = """
window.__sent = [];
window.__binary = 0;
const send = WebSocket.prototype.send;
WebSocket.prototype.send = function (data) {
    if (typeof data === "string") window.__sent.push(JSON.parse(data));
    else window.__binary += 1;
    return send.call(this, data);
};
"""


@pytest.fixture(autouse=True)
def this_checkouts_page(monkeypatch: pytest.MonkeyPatch) -> None:
    """Serve this checkout's page, whatever checkout the package's resources
    point at (an editable install maps them to one checkout only)."""
    for route, asset in list(web._ASSETS.items()):
        mine = ROOT / "clients" / asset.path.parent.name / asset.path.name
        if asset.path.parent.name in ("web", "js") and mine.is_file():
            monkeypatch.setitem(web._ASSETS, route, web._Asset(mine, asset.content_type))


@pytest.fixture(scope="module")
def vision_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("vision")
    return write_tiny_gguf(folder / "tiny.gguf"), write_tiny_mmproj(folder / "tiny.mmproj.gguf")


def vision_server(factory: Any, files: tuple[Path, Path]) -> Any:
    model, mmproj = files
    return factory(
        **{
            "backend.kind": "llama",
            "backend.llama.model": str(model),
            "backend.llama.n_threads": 1,
            "backend.llama.parallel": 1,
            "backend.llama.n_ctx": 512,
            "backend.llama.models": [{"name": "seer", "model": str(model), "mmproj": str(mmproj)}],
            "limits.max_tokens": 4096,
        }
    )


def page_options(page: Any) -> None:
    """Greedy, 12 tokens, no penalty: what openai_answer asks for."""
    page.locator("#model-picker").select_option("seer")
    page.fill("#max-tokens", "12")
    page.click("#sampling > summary")
    page.fill("#temperature", "0")
    page.fill("#repeat-penalty", "1")
    page.fill("#min-p", "0")


def paste_image(page: Any, image: bytes, name: str) -> None:
    page.evaluate(
        """([bytes, name]) => {
            const file = new File([new Uint8Array(bytes)], name, { type: "image/png" });
            const data = new DataTransfer();
            data.items.add(file);
            const prompt = document.getElementById("prompt");
            prompt.dispatchEvent(new ClipboardEvent("paste", { clipboardData: data, bubbles: true, cancelable: true }));
        }""",
        [list(image), name],
    )


def drop_image(page: Any, image: bytes, name: str, kind: str = "image/png") -> None:
    page.evaluate(
        """([bytes, name, kind]) => {
            const file = new File([new Uint8Array(bytes)], name, { type: kind });
            const data = new DataTransfer();
            data.items.add(file);
            const composer = document.getElementById("composer");
            composer.dispatchEvent(new DragEvent("dragover", { dataTransfer: data, bubbles: true, cancelable: true }));
            composer.dispatchEvent(new DragEvent("drop", { dataTransfer: data, bubbles: true, cancelable: true }));
        }""",
        [list(image), name, kind],
    )


def test_pick_paste_and_drop_an_image_it_is_sent_shown_and_kept(
    page: Any, live_server_factory: Any, vision_files: tuple[Path, Path], tmp_path: Path
) -> None:
    server = vision_server(live_server_factory, vision_files)
    page.add_init_script(RECORD_FRAMES)
    page.goto(server.http_url)
    expect(page.locator("#app")).to_have_attribute("data-connection", "open")
    page_options(page)
    thumbnails = page.locator("#attachments img.thumbnail")

    # Pick: the hidden file input behind the "Image" button.
    red_file = tmp_path / "red.png"
    red_file.write_bytes(RED)
    with page.expect_file_chooser() as chooser:
        page.click("#attach")
    chooser.value.set_files(str(red_file))
    expect(thumbnails).to_have_count(1)
    # Paste, then drop: two more; one removed again.
    paste_image(page, GRADIENT, "gradient.png")
    expect(thumbnails).to_have_count(2)
    drop_image(page, RED, "again.png")
    expect(thumbnails).to_have_count(3)
    page.locator("#attachments .remove-image").nth(1).click()  # the gradient
    expect(thumbnails).to_have_count(2)
    # What the server cannot read is refused here, with a note.
    drop_image(page, b"GIF89a", "anim.webp", "image/webp")
    expect(page.locator("#attach-note")).to_contain_text("anim.webp: not a PNG")
    expect(thumbnails).to_have_count(2)

    page.fill("#prompt", "Look at")
    page.press("#prompt", "Enter")
    expect(page.locator("#app")).to_have_attribute("data-state", "idle", timeout=60_000)
    expect(thumbnails).to_have_count(0)  # sent: the composer is empty again
    shown = page.locator(".message.user .images img.thumbnail")
    expect(shown).to_have_count(2)
    generate = [f for f in page.evaluate("() => window.__sent") if f["type"] == "generate"][-1]
    (message,) = generate["messages"]
    assert [list(i) for i in message["images"]] == [["upload"], ["upload"]]
    assert page.evaluate("() => window.__binary") == 2  # one small upload each

    # The same answer as OpenAI's chat API for the same two images and text.
    text = page.evaluate("() => window.chat.last().text")
    assert text
    assert text == openai_answer(server, [RED, RED], "Look at")

    # Kept with the conversation: after a reload, the thumbnails are there.
    page.reload()
    expect(page.locator("#app")).to_have_attribute("data-connection", "open")
    expect(page.locator(".message.user .images img.thumbnail")).to_have_count(2)


def openai_answer(server: Any, images: list[bytes], text: str) -> str:
    """OpenAI's chat API's greedy answer for ``images`` before ``text``."""
    parts: list[dict[str, Any]] = [
        {
            "type": "image_url",
            "image_url": {"url": "data:image/png;base64," + base64.b64encode(i).decode()},
        }
        for i in images
    ]
    body = {
        "model": "seer",
        "max_tokens": 12,
        "temperature": 0,
        "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}],
    }
    request = urllib.request.Request(
        server.http_url + "v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return str(json.load(response)["choices"][0]["message"]["content"])


def test_the_image_button_is_there_only_for_a_model_that_reads_images(
    page: Any, live_server_factory: Any, vision_files: tuple[Path, Path]
) -> None:
    """``hello`` says what each loaded model takes in: the text-only default
    model hides the Image button and refuses a paste or a drop with a note;
    the vision model (preloaded, so ``hello`` says it) shows it and takes them."""
    model, mmproj = vision_files
    server = live_server_factory(
        **{
            "backend.kind": "llama",
            "backend.llama.model": str(model),
            "backend.llama.n_threads": 1,
            "backend.llama.parallel": 1,
            "backend.llama.n_ctx": 512,
            "backend.llama.models": [
                {"name": "seer", "model": str(model), "mmproj": str(mmproj), "preload": True}
            ],
        }
    )
    page.goto(server.http_url)
    expect(page.locator("#app")).to_have_attribute("data-connection", "open")
    button, note = page.locator("#attach"), page.locator("#attach-note")
    thumbnails = page.locator("#attachments img.thumbnail")
    default = page.evaluate("() => window.chat.client.hello.model")
    assert default != "seer"

    # The text-only default model: no button; a paste and a drop are refused, said.
    expect(button).to_be_hidden()
    paste_image(page, RED, "red.png")
    expect(note).to_be_visible()
    expect(note).to_have_text(f"{default} does not read images: pick a model that does")
    drop_image(page, RED, "red.png")
    expect(thumbnails).to_have_count(0)

    # The vision model: the button, and the images are taken.
    page.locator("#model-picker").select_option("seer")
    expect(button).to_be_visible()
    expect(note).to_be_hidden()
    paste_image(page, RED, "red.png")
    expect(thumbnails).to_have_count(1)

    # Back to the text-only model with an image in the composer: kept, but
    # said, and not sent (Send disabled, Enter does nothing).
    page.locator("#model-picker").select_option(default)
    expect(button).to_be_hidden()
    expect(note).to_contain_text("does not read images")
    page.fill("#prompt", "Look at")
    expect(page.locator("#send")).to_be_disabled()
    page.press("#prompt", "Enter")
    expect(page.locator(".message.user")).to_have_count(0)
    expect(thumbnails).to_have_count(1)
