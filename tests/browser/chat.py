"""Helpers shared by the chat page's browser tests: drive the page like a user."""

from __future__ import annotations

from typing import Any

from .conftest import LiveServer

expect: Any
try:
    from playwright.sync_api import expect
except ImportError:  # the browser fixture skips or fails with the reason
    expect = None

__all__ = [
    "expect",
    "last_answer",
    "last_done",
    "messages_for",
    "open_chat",
    "open_sampling",
    "paste",
    "send",
    "set_options",
    "wait_text",
]


def open_chat(page: Any, server: LiveServer) -> None:
    page.goto(server.http_url)
    expect(page.locator("#app")).to_have_attribute("data-connection", "open")
    expect(page.locator("#model")).to_have_text("fake")


def set_options(
    page: Any,
    *,
    max_tokens: int | None = None,
    seed: int | None = None,
    temperature: float | None = None,
) -> None:
    if max_tokens is not None:
        page.fill("#max-tokens", str(max_tokens))
    if seed is not None:
        page.fill("#seed", str(seed))
    if temperature is not None:
        open_sampling(page)
        page.fill("#temperature", str(temperature))


def open_sampling(page: Any) -> None:
    """Open the "Sampling" disclosure (temperature, penalties, JSON) if it is closed."""
    if page.locator("#sampling").get_attribute("open") is None:
        page.click("#sampling > summary")
    expect(page.locator("#repeat-penalty")).to_be_visible()


def send(page: Any, text: str) -> None:
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def paste(page: Any, text: str) -> None:
    """Put a long prompt into the composer at once, as a paste does, and send it.

    (Playwright's ``fill`` types text with thousands of lines slowly.)"""
    page.evaluate(
        """(text) => {
            const prompt = document.getElementById('prompt');
            prompt.value = text;
            prompt.dispatchEvent(new Event('input', { bubbles: true }));
        }""",
        text,
    )
    page.press("#prompt", "Enter")


def last_answer(page: Any) -> Any:
    return page.locator(".message.assistant .text").last


def wait_text(page: Any, chars: int) -> None:
    """Wait until the streaming answer has shown at least ``chars`` characters."""
    page.wait_for_function(
        "chars => (document.querySelector('.message.assistant:last-of-type .text')"
        "?.textContent.length ?? 0) >= chars",
        arg=chars,
    )


def last_done(page: Any) -> dict[str, Any]:
    """The `done` frame of the latest answer (waits for it)."""
    return page.evaluate("() => window.chat.last().done")  # type: ignore[no-any-return]


def messages_for(prompt: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}]
