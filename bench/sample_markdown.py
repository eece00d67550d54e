"""A deterministic, markdown-heavy answer for the page benchmark.

Like a long technical answer from a chat model: headings, paragraphs with
bold, italics, inline code and links, bullet and numbered lists, fenced code
blocks in several languages, tables and quotes — every construct the page
renders, in proportions a reader of model output would recognise.
"""

from __future__ import annotations

import random

__all__ = ["markdown_text"]

_WORDS = [
    "stream",
    "token",
    "frame",
    "socket",
    "buffer",
    "model",
    "answer",
    "window",
    "client",
    "server",
    "queue",
    "pace",
    "cancel",
    "render",
    "block",
    "paragraph",
    "latency",
    "memory",
    "thread",
    "loop",
    "event",
    "reader",
    "writer",
    "request",
    "response",
    "producer",
    "consumer",
    "channel",
    "bounded",
    "merge",
    "flush",
    "budget",
]


def _sentence(rng: random.Random) -> str:
    words = [rng.choice(_WORDS) for _ in range(rng.randint(6, 16))]
    for _ in range(rng.randint(0, 2)):
        i = rng.randrange(len(words))
        words[i] = rng.choice(
            (
                f"**{words[i]}**",
                f"*{words[i]}*",
                f"`{words[i]}_ms`",
                f"[{words[i]}](https://example.com/{words[i]})",
            )
        )
    text = " ".join(words)
    return text[0].upper() + text[1:] + rng.choice((".", ".", ".", "?", "!"))


def _paragraph(rng: random.Random) -> str:
    return " ".join(_sentence(rng) for _ in range(rng.randint(2, 5)))


def _code(rng: random.Random) -> str:
    language = rng.choice(("python", "js", "sh"))
    lines = []
    for n in range(rng.randint(4, 14)):
        name = rng.choice(_WORDS)
        if language == "python":
            lines.append(f"{'    ' * (n % 3)}{name}_{n} = await {rng.choice(_WORDS)}({n})")
        elif language == "js":
            lines.append(f"{'  ' * (n % 3)}const {name}{n} = {rng.choice(_WORDS)}.get({n});")
        else:
            lines.append(f"wsserver {name} --{rng.choice(_WORDS)}={n}")
    return f"```{language}\n" + "\n".join(lines) + "\n```"


def _table(rng: random.Random) -> str:
    rows = ["| setting | value | meaning |", "|---|---:|---|"]
    for _ in range(rng.randint(3, 6)):
        rows.append(
            f"| `{rng.choice(_WORDS)}_{rng.choice(_WORDS)}` | {rng.randint(1, 999)} | "
            f"{_sentence(rng)[:-1]} |"
        )
    return "\n".join(rows)


def _list(rng: random.Random) -> str:
    ordered = rng.random() < 0.5
    items = []
    for n in range(rng.randint(3, 7)):
        marker = f"{n + 1}." if ordered else "-"
        items.append(f"{marker} {_sentence(rng)}")
    return "\n".join(items)


def markdown_text(chars: int, seed: int = 0) -> str:
    """Markdown of at most ``chars`` characters, ending at a block boundary."""
    rng = random.Random(seed)
    blocks: list[str] = []
    size = 0
    section = 0
    while True:
        if section == 0 or rng.random() < 0.12:
            section += 1
            level = "##" if rng.random() < 0.5 else "###"
            block = f"{level} {section}. {_sentence(rng)[:-1]}"
        else:
            block = rng.choice((_paragraph, _paragraph, _paragraph, _list, _code, _table))(rng)
            if rng.random() < 0.05:
                block = "> " + _sentence(rng)
        if size + len(block) + 2 > chars:
            return "\n\n".join(blocks) + "\n"
        blocks.append(block)
        size += len(block) + 2
