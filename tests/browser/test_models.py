"""The chat page's model picker (issue 23): from ``hello.models``, kept per conversation.

The engine is the fake one, declaring two models as an engine that chooses
among several does (``Backend.served_models``, as the openai relay routes by
model): what is checked is the ``model`` the page asks for, per conversation,
and what the server answered with (``done.model``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from wsserver.aio import web
from wsserver.backends.fake import FakeBackend

from .chat import expect, last_done, open_chat, send
from .test_conversations import RECORD_SENT, generates

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.browser


class TwoModels(FakeBackend):
    """The fake engine, serving "fast" (loaded) and "big" (not loaded)."""

    def __init__(self) -> None:
        super().__init__(tokens_per_s=0.0, echo=True)
        self.model_name = "fast"

    def served_models(self) -> dict[str, bool] | None:
        return {"fast": True, "big": False}


@pytest.fixture(autouse=True)
def this_checkouts_page(monkeypatch: pytest.MonkeyPatch) -> None:
    """Serve this checkout's page, whatever checkout the package's resources
    point at (an editable install maps them to one checkout only)."""
    for route, asset in list(web._ASSETS.items()):
        mine = ROOT / "clients" / asset.path.parent.name / asset.path.name
        if asset.path.parent.name in ("web", "js") and mine.is_file():
            monkeypatch.setitem(web._ASSETS, route, web._Asset(mine, asset.content_type))


def turn(page: Any, text: str) -> dict[str, Any]:
    send(page, text)
    done: dict[str, Any] = last_done(page)
    expect(page.locator("#app")).to_have_attribute("data-state", "idle")
    return done


def test_the_picker_chooses_each_conversations_model(page: Any, live_server_factory: Any) -> None:
    page.add_init_script(RECORD_SENT)
    server = live_server_factory(backend=TwoModels)
    page.goto(server.http_url)
    expect(page.locator("#app")).to_have_attribute("data-connection", "open")
    picker = page.locator("#model-picker")
    expect(picker).to_be_visible()
    expect(page.locator("#model")).to_be_hidden()
    expect(picker.locator("option")).to_have_text(["fast", "big (unloaded)"])
    expect(picker).to_have_value("fast")

    picker.select_option("big")
    assert turn(page, "about cats")["model"] == "big"
    assert generates(page)[-1]["model"] == "big"

    page.click("#new-chat")
    expect(picker).to_have_value("big")  # a new chat starts with the last pick
    picker.select_option("fast")
    assert turn(page, "about dogs")["model"] == "fast"
    assert generates(page)[-1]["model"] == "fast"

    page.click("#history li:has-text('about cats') .open-chat")
    expect(picker).to_have_value("big")
    page.reload()
    expect(page.locator("#app")).to_have_attribute("data-connection", "open")
    expect(page.locator(".message.user .text")).to_have_text(["about cats"])
    expect(picker).to_have_value("big")
    page.click("#history li:has-text('about dogs') .open-chat")
    expect(picker).to_have_value("fast")


def test_one_model_shows_its_name_and_no_picker(page: Any, live_server_factory: Any) -> None:
    server = live_server_factory()
    open_chat(page, server)
    expect(page.locator("#model-picker")).to_be_hidden()
    expect(page.locator("#model")).to_be_visible()
