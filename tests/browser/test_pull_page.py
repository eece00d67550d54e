"""The chat page and models by name (issue 38), in Chromium.

* A model without a chat template (a base model, as the bundled 270M one) gets
  a notice that says so and names the command that serves a chat model.
* Where the server lets the page pull (``models.allow_pull``, with the token),
  the "Get a model" dialog downloads a model from the (local imitation of
  the) Hub with its progress, cancels and resumes, and the model lands in
  the picker, chosen for the conversation, and answers.
* A request for a configured ``hf:`` model still downloading says so.

The real llama engine serves tiny random GGUFs (tests/tiny_gguf.py).
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fake_hub import FakeHub, sha256
from tiny_gguf import write_tiny_gguf

from wsserver.aio import web

from .chat import expect, last_done, send
from .conftest import ms

pytest.importorskip("llama_cpp")

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "s3cret-token"
MiB = 1 << 20
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(autouse=True)
def this_checkouts_page(monkeypatch: pytest.MonkeyPatch) -> None:
    """Serve this checkout's page (an editable install may point at another)."""
    for route, asset in list(web._ASSETS.items()):
        mine = ROOT / "clients" / asset.path.parent.name / asset.path.name
        if asset.path.parent.name in ("web", "js") and mine.is_file():
            monkeypatch.setitem(web._ASSETS, route, web._Asset(mine, asset.content_type))


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("page-models")
    return {
        "base": write_tiny_gguf(folder / "base.gguf"),
        # Big enough (4.5 MB) to be caught mid-download, with a chat template.
        "chat": write_tiny_gguf(
            folder / "chat.gguf", n_layer=4, n_embd=128, n_ff=512, chat_template=TEMPLATE
        ),
    }


@pytest.fixture
def hub(ggufs: dict[str, Path]) -> Iterator[FakeHub]:
    with FakeHub() as fake:
        fake.add_repo("org/chat-GGUF", {"chat-Q4_K_M.gguf": ggufs["chat"].read_bytes()})
        yield fake


def llama(ggufs: dict[str, Path], hub: FakeHub, cache: Path, **more: Any) -> dict[str, Any]:
    values = {
        "backend.kind": "llama",
        "backend.llama.model": str(ggufs["base"]),
        "backend.llama.n_threads": 1,
        "backend.llama.n_ctx": 256,
        "backend.llama.parallel": 2,
        "models.endpoint": hub.url,
        "models.cache_dir": str(cache),
        "stream.flush_ms": 0.0,
    }
    values.update(more)
    return values


def authorized_page(browser: Any) -> Any:
    basic = base64.b64encode(f"user:{TOKEN}".encode()).decode()
    context = browser.new_context(
        extra_http_headers={"Authorization": f"Basic {basic}"},
        bypass_csp=True,
        viewport={"width": 1000, "height": 760},
    )
    context.set_default_timeout(ms(10))
    expect.set_options(timeout=ms(10))
    return context


def test_a_base_model_is_named_as_such_with_the_way_to_a_chat_model(
    page: Any, live_server_factory: Any, ggufs: dict[str, Path], hub: FakeHub, tmp_path: Path
) -> None:
    server = live_server_factory(**llama(ggufs, hub, tmp_path))
    page.goto(server.http_url)
    expect(page.locator("#app")).to_have_attribute("data-connection", "open")
    notice = page.locator("#base-model")
    expect(notice).to_be_visible()
    expect(notice).to_contain_text("base has no chat template: it is a base model")
    expect(notice).to_contain_text("scripts/serve --model hf:ggml-org/gemma-3-1b-it-GGUF")
    # This server lets no page pull: no button, only the command.
    expect(page.locator("#base-model-get")).to_be_hidden()
    expect(page.locator("#get-model")).to_be_hidden()


def test_a_model_with_a_template_gets_no_notice(
    page: Any, live_server_factory: Any, ggufs: dict[str, Path], hub: FakeHub, tmp_path: Path
) -> None:
    config = llama(ggufs, hub, tmp_path, **{"backend.llama.model": str(ggufs["chat"])})
    server = live_server_factory(**config)
    page.goto(server.http_url)
    expect(page.locator("#app")).to_have_attribute("data-connection", "open")
    expect(page.locator("#model")).to_have_text("chat")
    expect(page.locator("#base-model")).to_be_hidden()


def test_get_a_model_downloads_it_with_progress_and_puts_it_in_the_picker(
    browser: Any, live_server_factory: Any, ggufs: dict[str, Path], hub: FakeHub, tmp_path: Path
) -> None:
    config = llama(
        ggufs, hub, tmp_path, **{"models.allow_pull": True, "security.auth_token": TOKEN}
    )
    server = live_server_factory(**config)
    server.server.pulls.interval = 0.02
    digest = sha256(ggufs["chat"].read_bytes())
    context = authorized_page(browser)
    try:
        page = context.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda error: errors.append(str(error)))
        page.goto(server.http_url + "#token=" + TOKEN)
        expect(page.locator("#app")).to_have_attribute("data-connection", "open")
        expect(page.locator("#get-model")).to_be_visible()
        page.click("#base-model-get")  # the base model's notice offers it too
        dialog = page.locator("#pull-dialog")
        expect(dialog).to_be_visible()
        reference = page.locator("#pull-reference")
        expect(reference).to_have_value("ggml-org/gemma-3-1b-it-GGUF")
        reference.fill("org/chat-GGUF")

        status = page.locator("#pull-status")
        with hub.held(digest, after=2 * MiB + MiB // 2):
            page.click("#pull-start")
            expect(status).to_contain_text(
                "Downloading chat-Q4_K_M.gguf · 4"
            )  # 44 %: 2 MiB written
            expect(status).to_contain_text("MB of 4.5 MB")
            assert float(page.locator("#pull-bar").get_attribute("value") or 0) >= 2 * MiB
            page.click("#pull-cancel")
            expect(status).to_contain_text("Cancelled. What was downloaded is kept")
        expect(page.locator("#pull-cancel")).to_be_hidden()

        page.click("#pull-start")  # again: it resumes
        expect(status).to_contain_text(
            "Ready: org/chat-GGUF is in the model picker", timeout=ms(30)
        )
        expect(page.locator("#pull-keep")).to_contain_text('model = "hf:org/chat-GGUF"')
        assert hub.gets_of(digest)[-1].start == 2 * MiB  # nothing came twice
        page.click("#pull-close")
        expect(dialog).to_be_hidden()

        picker = page.locator("#model-picker")
        expect(picker).to_be_visible()
        expect(picker).to_have_value("org/chat-GGUF")
        expect(page.locator("#base-model")).to_be_hidden()
        send(page, "Hello! Who are you?")
        done = last_done(page)
        assert done["model"] == "org/chat-GGUF"
        assert not errors, errors
    finally:
        context.close()


def test_a_request_for_a_model_still_downloading_shows_the_download(
    page: Any, live_server_factory: Any, ggufs: dict[str, Path], hub: FakeHub, tmp_path: Path
) -> None:
    models = [{"name": "chat", "model": "hf:org/chat-GGUF"}]
    server = live_server_factory(**llama(ggufs, hub, tmp_path, **{"backend.llama.models": models}))
    server.server.pulls.interval = 0.02
    digest = sha256(ggufs["chat"].read_bytes())
    page.goto(server.http_url)
    expect(page.locator("#app")).to_have_attribute("data-connection", "open")
    page.locator("#model-picker").select_option("chat")
    with hub.held(digest, after=2 * MiB + MiB // 2):
        send(page, "Hello")
        expect(page.locator("#activity")).to_contain_text(
            "Getting the model — Downloading chat-Q4_K_M.gguf · 4"
        )
    assert last_done(page)["model"] == "chat"
