"""Section 16 — bounded chat templates: what a render costs in a worker process.

Since issue 34 the server never compiles nor renders a GGUF's chat template
itself: a worker process does, under a time and a memory bound
(``wsserver/backends/llama_template_pool.py``). This section measures what
that costs, on Qwen 2.5 Instruct's template (ChatML with tools), for a
conversation of one turn and one of 100 messages (with two tools):

* **in-process** — :class:`~wsserver.backends.llama_template.ChatTemplate`
  rendering in the calling thread, as every render was before;
* **worker, new input** — :class:`~.llama_template_pool.BoundedTemplate`
  with an input it has not seen: to the worker and back over two pipes
  (JSON framing, the digest of the input, the worker's render);
* **worker, remembered** — the same input again (a request's later
  questions about its prompt): a digest and a look-up;
* **a thread hand-over** — ``asyncio.to_thread`` of a no-op: the check of a
  chat request and its preparation now each run on a worker thread.

Each figure is the median over batches of calls, timed with
``time.perf_counter`` in this process (no model, no server); the batches of
each kind alternate and the added time is the median of the per-pair
differences, so that the machine's drift cancels out. The input differs per
call where it must (the last message carries the call's number).
Also: the time to start the first worker and load the template (model load),
and an idle worker's resident memory.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable
from typing import Any

from wsserver.backends.llama_template import ChatTemplate
from wsserver.backends.llama_template_pool import BoundedTemplate, TemplatePool
from wsserver.core.protocol import Message, ToolCall

from .options import Options

#: Qwen 2.5 Instruct's chat template (tokenizer_config.json), as its GGUFs carry it.
QWEN25 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"Look up the {name} of a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                "required": ["city"],
            },
        },
    }
    for name in ("weather", "time")
]


def conversation(turns: int, last: str) -> tuple[Message, ...]:
    """A system message, ``turns`` user/assistant turns (every fifth answered
    through a tool call: the call, its result, then the answer), then ``last``
    from the user: 2 + 2 x ``turns`` + 2 x ``turns // 5`` messages."""
    messages = [Message("system", "You are a helpful assistant. Answer briefly.")]
    for i in range(turns):
        messages.append(Message("user", f"Question {i}: what about the weather in city {i}? " * 2))
        if i % 5 == 4:
            call = ToolCall(f"call_{i}", "weather", f'{{"city": "City {i}"}}')
            messages.append(Message("assistant", "", tool_calls=(call,)))
            result = f'{{"temperature": {i}, "unit": "c"}}'
            messages.append(Message("tool", result, tool_call_id=f"call_{i}"))
        messages.append(Message("assistant", f"In city {i} it is sunny, about {i} degrees. " * 2))
    messages.append(Message("user", last))
    return tuple(messages)


def _batch_us(calls: int, call: Callable[[int], object], first: int) -> float:
    """The mean time of ``calls`` calls (``call(first)``, ``call(first + 1)``, …), in µs."""
    started = time.perf_counter()
    for n in range(first, first + calls):
        call(n)
    return (time.perf_counter() - started) / calls * 1e6


async def _hand_over_us(calls: int) -> float:
    samples = []
    for _ in range(calls):
        started = time.perf_counter()
        await asyncio.to_thread(lambda: None)
        samples.append((time.perf_counter() - started) * 1e6)
    return statistics.median(samples)


async def run(opts: Options) -> dict[str, Any]:
    batches, calls = (3, 20) if opts.quick else (9, 200)
    out: dict[str, Any] = {"status": "ok", "batches": batches, "calls": calls, "cases": []}
    in_process = ChatTemplate(QWEN25)
    started = time.perf_counter()
    compiled_here = ChatTemplate(QWEN25)
    out["compile_in_process_ms"] = (time.perf_counter() - started) * 1e3
    del compiled_here
    pool = TemplatePool()
    try:
        started = time.perf_counter()
        bounded = pool.load(QWEN25)
        out["first_worker_and_load_ms"] = (time.perf_counter() - started) * 1e3
        out["idle_worker_rss_bytes"] = _rss(pool.pids()[0])
        for label, turns, tools in (("one turn", 0, None), ("100 messages, 2 tools", 41, TOOLS)):
            case = _case(label, turns, tools, in_process, bounded, batches, calls)
            out["cases"].append(case)
            opts.log(
                f"  templates: {label}: in-process {case['in_process_us']:.0f} µs, worker "
                f"{case['worker_us']:.0f} µs, remembered {case['remembered_us']:.0f} µs"
            )
    finally:
        pool.close()
    out["hand_over_us"] = await _hand_over_us(50 if opts.quick else 500)
    return out


def _case(
    label: str,
    turns: int,
    tools: list[dict[str, Any]] | None,
    in_process: ChatTemplate,
    bounded: BoundedTemplate,
    batches: int,
    calls: int,
) -> dict[str, Any]:
    messages = conversation(turns, "And now?")
    # A new input per call (the last message carries its number): no memo hit.
    inputs = [conversation(turns, f"And now? ({n})") for n in range(batches * calls * 2)]
    bounded.render(messages, tools=tools)
    here, fresh, again, added = [], [], [], []
    # Batches of each kind alternate, and the added time is taken per pair:
    # the machine's drift between batches cancels out.
    for batch in range(batches):
        first = batch * calls
        here.append(_batch_us(calls, lambda n: in_process.render(inputs[n], tools=tools), first))
        fresh.append(_batch_us(calls, lambda n: bounded.render(inputs[-1 - n], tools=tools), first))
        again.append(_batch_us(calls, lambda n: bounded.render(messages, tools=tools), first))
        added.append(fresh[-1] - here[-1])
    return {
        "label": label,
        "messages": len(messages),
        "prompt_chars": len(in_process.render(messages, tools=tools)),
        "in_process_us": statistics.median(here),
        "worker_us": statistics.median(fresh),
        "added_us": statistics.median(added),
        "added_us_range": [min(added), max(added)],
        "remembered_us": statistics.median(again),
    }


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def render(r: dict[str, Any]) -> str:
    lines = [
        "Qwen 2.5 Instruct's chat template (ChatML with tools). Each figure is the median over "
        f"{r['batches']} batches of {r['calls']} calls of the mean time per call (the three kinds "
        "alternate, and the added time is taken per pair of batches), in this process "
        "(no model, no server). *In-process*: rendered in the calling thread, as every render was "
        "before issue 34. *Worker*: an input the worker pool has not seen — JSON over two pipes, "
        "the worker's render, the answer back. *Remembered*: the same input again (a request's "
        "later questions about its prompt), answered from the template's memo of recent renders.",
        "",
        "| conversation | messages | prompt (characters) | in-process (µs) | worker (µs) "
        "| **added per render (µs)** (range over batches) | remembered (µs) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for case in r["cases"]:
        low, high = case["added_us_range"]
        lines.append(
            f"| {case['label']} | {case['messages']} | {case['prompt_chars']:,} "
            f"| {case['in_process_us']:.0f} | {case['worker_us']:.0f} "
            f"| **{case['added_us']:+.0f}** ({low:+.0f} to {high:+.0f}) "
            f"| {case['remembered_us']:.1f} |"
        )
    hop = r["hand_over_us"]
    lines += [
        "",
        "Per request: a chat request asked the template for the same render 4 times before "
        "(check, context check, the loop's think-block question, the engine's admission; 17 "
        "with `tools`: each of those also rendered with and without them, and the forced-call "
        "and tool-syntax questions too) — counted on a tiny model. Now the first ask of each "
        "input goes to a worker (1 without tools, 2 with) and the others are remembered, and "
        "the check and the preparation each hand over to a thread. Estimated from the figures "
        "above:",
        "",
        "| conversation | renders before | before (µs) | after (µs) | **added per request (µs)** |",
        "|---|---:|---:|---:|---:|",
    ]
    for case, (asks, misses) in zip(r["cases"], ((4, 1), (17, 2)), strict=False):
        before = asks * case["in_process_us"]
        after = misses * case["worker_us"] + (asks - misses) * case["remembered_us"] + 2 * hop
        lines.append(
            f"| {case['label']} | {asks} | {before:.0f} | {after:.0f} | **{after - before:+.0f}** |"
        )
    lines += [
        "",
        "Before, for an input up to 4 KiB, 3 of those renders (14 with `tools`) ran on the "
        "event loop and 1 (3) on the engine thread, unbounded; now none does.",
        "",
        f"A thread hand-over (`asyncio.to_thread` of a no-op, median): {r['hand_over_us']:.0f} µs; "
        "a chat request's check and its preparation each take one. Model load: the first worker "
        f"started and the template compiled and probed in it in {r['first_worker_and_load_ms']:.0f} ms "
        f"(compiling in-process: {r['compile_in_process_ms']:.1f} ms); an idle worker holds "
        f"{r['idle_worker_rss_bytes'] / 2**20:.1f} MiB resident.",
    ]
    return "\n".join(lines)
