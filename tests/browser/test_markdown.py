"""The chat page renders answers as sanitized markdown, incrementally.

The fake backend echoes the prompt (``backend.fake.echo``), so each test
streams exactly the markdown it typed, cut into word-sized tokens the way a
model sends them.
"""

from __future__ import annotations

from typing import Any

import pytest

from .chat import expect, last_done, open_chat, paste, set_options
from .conftest import LiveServer

pytestmark = pytest.mark.browser

ANSWER = ".message.assistant:last-of-type .text"

CONSTRUCTS = """\
## A heading

Some **bold**, some *emphasis*, `inline code` and [a link](https://example.com/docs).

- first item
- second item

1. one
2. two

```python
def hello():
    return "<b>not markup</b>"
```

| name | value |
|------|------:|
| flush_ms | 30 |

> a quote
"""


def echo_server(factory: Any, rate: float = 0, **overrides: Any) -> LiveServer:
    values = {"backend.fake.echo": True, "backend.fake.tokens_per_s": rate}
    values.update(overrides)
    return factory(**values)  # type: ignore[no-any-return]


def ask(page: Any, markdown: str) -> dict[str, Any]:
    """Send ``markdown`` (echoed back as the answer) and wait for its done."""
    set_options(page, max_tokens=100_000)
    paste(page, markdown)
    done = last_done(page)
    expect(page.locator("#app")).to_have_attribute("data-state", "idle")
    return done


def blocks_html(page: Any) -> str:
    """The answer's rendered blocks, without the block wrappers."""
    return page.evaluate(  # type: ignore[no-any-return]
        f"""() => [...document.querySelectorAll('{ANSWER} > .block > *')]
            .map((e) => e.outerHTML).join('')"""
    )


@pytest.mark.parametrize("context", [{"csp": True}], indirect=True)
def test_each_construct_renders(page: Any, live_server_factory: Any) -> None:
    # Under the page's own Content-Security-Policy: the vendored modules load
    # from the server, and nothing they do needs more than 'self'.
    page.add_init_script(
        """window.__violations = [];
        document.addEventListener('securitypolicyviolation',
            (e) => window.__violations.push(e.violatedDirective + ' ' + e.blockedURI));"""
    )
    open_chat(page, echo_server(live_server_factory))
    assert ask(page, CONSTRUCTS)["reason"] == "stop"
    answer = page.locator(ANSWER)
    expect(answer.locator("h2")).to_have_text("A heading")
    expect(answer.locator("strong")).to_have_text("bold")
    expect(answer.locator("em")).to_have_text("emphasis")
    expect(answer.locator("p > code")).to_have_text("inline code")
    link = answer.locator("a")
    expect(link).to_have_text("a link")
    expect(link).to_have_attribute("href", "https://example.com/docs")
    expect(link).to_have_attribute("target", "_blank")
    expect(link).to_have_attribute("rel", "noopener noreferrer nofollow")
    expect(answer.locator("ul > li")).to_have_text(["first item", "second item"])
    expect(answer.locator("ol > li")).to_have_text(["one", "two"])
    code = answer.locator("figure.code")
    expect(code.locator(".lang")).to_have_text("python")
    expect(code.locator("button.copy")).to_have_text("Copy")
    expect(code.locator("pre > code")).to_have_text('def hello():\n    return "<b>not markup</b>"')
    expect(answer.locator("table th")).to_have_text(["name", "value"])
    expect(answer.locator("table td")).to_have_text(["flush_ms", "30"])
    expect(answer.locator("blockquote")).to_have_text("a quote")
    # Nothing of the code became markup.
    expect(answer.locator("figure.code b")).to_have_count(0)
    assert page.evaluate("() => window.__violations") == []


def test_incremental_render_equals_a_whole_render_and_keeps_finished_blocks(
    page: Any, live_server_factory: Any
) -> None:
    """Finished blocks are rendered once and never touched again; the result
    is what rendering the whole answer at once gives (the page does that for
    a restored conversation after a reload)."""
    open_chat(page, echo_server(live_server_factory, rate=2000))
    page.evaluate(
        """() => {
            // Mutation records arrive in order: once a block has a block after
            // it, it is finished, and no record may touch it again.
            const probe = window.__blocks = { sealed: new Set(), touched: 0, blocks: 0 };
            const log = document.getElementById('log');
            new MutationObserver((records) => {
                for (const r of records) {
                    const target = r.target.nodeType === Node.ELEMENT_NODE ? r.target : r.target.parentElement;
                    if (target.classList.contains('text') && target.closest('.assistant')) {
                        for (const added of r.addedNodes) {
                            probe.blocks++;
                            for (let b = added.previousElementSibling; b; b = b.previousElementSibling) {
                                probe.sealed.add(b);
                            }
                        }
                        continue;
                    }
                    const block = target.closest('.block');
                    if (block && probe.sealed.has(block)) probe.touched++;
                }
            }).observe(log, { childList: true, characterData: true, subtree: true });
        }"""
    )
    # Many blocks, a long paragraph (rendered in parts while open) and a long
    # code block (appended to while open).
    long_paragraph = " ".join(f"word{n} *em{n}*" for n in range(600))
    code = "\n".join(f"line {n} = {n} * 2" for n in range(300))
    sections = [f"### Part {n}\n\nText of part {n} with `code` and **bold**." for n in range(40)]
    markdown = "\n\n".join([*sections, long_paragraph, f"```js\n{code}\n```", "The end."])
    ask(page, markdown)
    probe = page.evaluate(
        "() => ({ touched: window.__blocks.touched, blocks: window.__blocks.blocks })"
    )
    assert probe["blocks"] >= 5  # it did stream, over many renders
    assert probe["touched"] == 0
    streamed = blocks_html(page)
    page.reload()
    expect(page.locator(ANSWER)).to_have_count(1)
    assert blocks_html(page) == streamed
    expect(page.locator(f"{ANSWER} h3")).to_have_count(40)
    expect(page.locator(f"{ANSWER} pre > code")).to_have_text(code)


def test_unclosed_code_fence_shows_as_code_while_streaming_and_after_stop(
    page: Any, live_server_factory: Any
) -> None:
    open_chat(page, echo_server(live_server_factory, rate=100))
    lines = [f"print({n})" for n in range(2000)]  # ~30 s at 100 tokens/s
    set_options(page, max_tokens=100_000)
    paste(page, "Here is code:\n\n```py\n" + "\n".join(lines) + "\n```\n\nAfter.")
    code = page.locator(f"{ANSWER} figure.code pre > code")
    expect(code).to_contain_text("print(3)")
    expect(page.locator("#app")).to_have_attribute("data-state", "streaming")
    expect(page.locator(f"{ANSWER} figure.code .lang")).to_have_text("py")
    page.click("#stop")
    assert last_done(page)["reason"] == "cancelled"
    # Stopped in the middle of the block: it stays code, with what had arrived.
    streamed = page.evaluate("() => window.chat.last().text")
    shown = code.text_content()
    assert streamed.startswith("Here is code:\n\n```py\nprint(0)")
    assert "After." not in streamed
    assert shown == streamed.split("```py\n", 1)[1].rstrip("\n")
    expect(page.locator(f"{ANSWER} p")).to_have_text("Here is code:")
    expect(page.locator(".message.assistant .meta")).to_contain_text("stopped")


@pytest.mark.parametrize("rate", [0, 50])
def test_model_output_is_sanitized(page: Any, live_server_factory: Any, rate: float) -> None:
    hostile = "\n\n".join(
        [
            "<script>window.__pwned = 'script'</script>",
            "Inline <img src=x onerror=\"window.__pwned='img'\"> image.",
            "[a js link](javascript:window.__pwned='link') and "
            "<a href=\"javascript:window.__pwned='a'\">raw a</a>",
            "![an image](https://example.com/x.png) and [data](data:text/html,<b>x</b>)",
            '<iframe src="https://example.com"></iframe><style>body{display:none}</style>',
            "[relative](/healthz) and [fine](https://example.com/ok) and <https://example.com/auto>",
            "<div onclick=\"window.__pwned='div'\">click</div>",
        ]
    )
    page.add_init_script("window.__pwned = null;")
    open_chat(page, echo_server(live_server_factory, rate=rate))
    ask(page, hostile)
    answer = page.locator(ANSWER)
    for tag in ("script", "img", "iframe", "style", "div[onclick]", "[onerror]", "[onclick]"):
        expect(answer.locator(tag)).to_have_count(0)
    hrefs = answer.locator("a").evaluate_all("links => links.map((a) => a.getAttribute('href'))")
    # Only http(s) and mailto links keep a target.
    assert [h for h in hrefs if h is not None] == [
        "https://example.com/x.png",
        "https://example.com/ok",
        "https://example.com/auto",
    ], hrefs
    # Raw HTML is shown as the text it is.
    expect(answer).to_contain_text("<script>window.__pwned = 'script'</script>")
    expect(answer).to_contain_text("<img src=x")
    assert page.evaluate("() => window.__pwned") is None


@pytest.mark.parametrize("context", [{"permissions": True}], indirect=True)
def test_copy_code_and_copy_the_answer_as_markdown(page: Any, live_server_factory: Any) -> None:
    open_chat(page, echo_server(live_server_factory))
    ask(page, CONSTRUCTS)
    page.click(f"{ANSWER} figure.code button.copy")
    expect(page.locator(f"{ANSWER} figure.code button.copy")).to_have_text("Copied")
    assert page.evaluate("() => navigator.clipboard.readText()") == (
        'def hello():\n    return "<b>not markup</b>"'
    )
    page.click(".message.assistant:last-of-type button.copy-answer")
    expect(page.locator(".message.assistant:last-of-type button.copy-answer")).to_have_text(
        "Copied"
    )
    assert page.evaluate("() => navigator.clipboard.readText()") == CONSTRUCTS


def test_plain_rendering_shows_the_source(page: Any, live_server_factory: Any) -> None:
    server = echo_server(live_server_factory)
    page.goto(server.http_url + "?render=plain")
    expect(page.locator("#app")).to_have_attribute("data-connection", "open")
    ask(page, CONSTRUCTS)
    assert page.locator(ANSWER).text_content() == CONSTRUCTS
    expect(page.locator(f"{ANSWER} h2")).to_have_count(0)
