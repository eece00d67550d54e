"""The engine seam: what a model must provide to be served (sans-I/O).

Theory of operation
-------------------
The server hands an engine one started request at a time with
:meth:`Backend.submit`: the request, the *slot* the scheduler granted it, the
request's bounded :class:`Sink` and its :class:`CancelEvent`. ``submit`` is
called on the event loop and returns at once with a :class:`Submission`; from
then on the engine owns the request until it calls
:meth:`Submission.complete`. What it produces goes into the sink, from
whatever thread or task the engine runs on. Three kinds of engine fit:

1. **A thread per request** (:class:`~.threaded.ThreadedBackend`; the fake and llama
   backends). ``submit`` starts a thread that runs a blocking
   :meth:`~.threaded.ThreadedBackend.generate`. :meth:`Sink.emit` blocks that thread
   while the channel is full — the backpressure — and raises
   :class:`~wsserver.errors.GenerationCancelled` the instant the request is
   cancelled, even while it waits.
2. **Batched** — one engine thread serving many sequences in one model
   context. Per step it hands each sequence's text to :meth:`Sink.offer`,
   which never blocks: ``False`` means that request's channel is full, so the
   sequence sits out the next steps while the others keep their pace, and
   :meth:`Sink.when_room` wakes the engine when the client has read enough to
   take it back. A :meth:`CancelEvent.add_callback` marks a sequence for
   removal (and may raise a native abort flag for a decode in flight).
3. **Async upstream** — relays another server over HTTP on the event loop.
   ``submit`` (already on the loop) creates a task per request. Before it
   reads the next chunk of its upstream stream for a request it waits for
   room (``when_room`` completing a future through
   ``loop.call_soon_threadsafe``), so a slow client stops the reading of its
   own upstream and no other. A cancel callback cancels the task.

What an engine produces is final text — decoded, stop strings applied —
and the core shapes it into the client's parts (:mod:`wsserver.shaping.shaper`:
the answer, the reasoning, the tool calls), the same way for every engine.
To do that for a request it asks the engine one question,
:meth:`Backend.output_format`: whether the prompt opened a think block, and
in which syntax the model's calls come. A model's calls are written in its
text and parsed by the core; an engine that parses them itself (an
upstream that streams ``tool_calls``) says ``relay`` and hands each part
over with :meth:`Sink.offer_call`, in order with its text — never written
into the text, where a model could forge one.

**Embeddings** (docs/embeddings.md) enter by a second door of the same
kind, one object per loaded model (:meth:`Backend.embeddings`,
:mod:`.embed_door`).

Slots are the engine's to declare (:attr:`Backend.slots`): contexts for a
threaded engine, sequences for a batched one, concurrent upstream streams for
an async one. The server's scheduler queues requests for them (first come,
first served, connections in turn) and never grants a slot to two requests
at once.

What an engine guarantees
-------------------------
* **One end per request.** It calls :meth:`Sink.end` at most once, last,
  and :meth:`Submission.complete` exactly once, after its last call into the
  sink, when the slot may serve the next request. (A request completed without
  an end still gets one ``done``, as ``internal``: that is a bug in the engine.)
* **Nothing after cancel.** Once ``cancel`` is set the engine stops within one
  step — also inside a long computation such as a prompt prefill, if it can be
  interrupted — and completes. The sink drops anything delivered after the
  cancel, so no late text reaches the client whatever the engine does.
* **Errors carry their wire code.** A failed request ends with an
  :class:`Outcome` of reason ``error`` and a code from
  :data:`~wsserver.errors.WIRE_CODES` (a threaded engine raises
  :class:`~wsserver.errors.BackendError`; the adapter translates it).
  Third-party exception text never reaches the client.

Nothing here imports asyncio: the sink and the submission are thread-safe
and wake their waiters through callbacks, which the asyncio layer bridges to
the loop.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ..core.call_parts import CallPart
from ..core.events import Outcome
from ..core.logprobs import TokenLogprob
from ..core.protocol import Generate
from ..core.sampling import options_asked
from ..errors import ProtocolError
from ..shaping.shaper import OutputFormat
from .embed_door import EmbedDoor
from .handles import CancelEvent, Submission
from .request import GenerationRequest, check_images

__all__ = [
    "Backend",
    "CancelEvent",
    "GenerationRequest",
    "Liveness",
    "Outcome",
    "OutputFormat",
    "PromptCacheFigures",
    "Sink",
    "Submission",
    "TokenSink",
    "UpstreamStats",
]


@dataclass(frozen=True, slots=True)
class UpstreamStats:
    """One upstream server of an engine that relays others, for ``/metrics``."""

    url: str
    in_flight: int
    #: In rotation (not taken out after a failure).
    healthy: bool
    requests: int
    errors: int
    #: Sum and count of the seconds from sending a request to its stream's first byte.
    first_byte_seconds_sum: float
    first_byte_count: int


@dataclass(frozen=True, slots=True)
class PromptCacheFigures:
    """An engine's prompt cache in host memory, for ``/metrics`` (the llama
    engine's: docs/llama.md, "Host-memory prompt cache")."""

    #: Requests whose prompt was restored from it, since the server started.
    hits: int = 0
    #: Prompt tokens restored from it (not decoded again), since the server started.
    restored_tokens: int = 0
    #: Bytes it holds now (0 while the model is unloaded).
    bytes: int = 0


@dataclass(frozen=True, slots=True)
class Liveness:
    """Whether an engine is making progress (``/metrics``; ``/readyz`` reads
    :meth:`Backend.unready_reason`)."""

    #: How long the engine's running step has lasted (0: none runs; an engine
    #: without steps: always 0).
    step_seconds: float = 0.0
    #: The step has lasted past the engine's stall bound.
    stalled: bool = False
    #: Grammar computations the engine gave up on that still run natively.
    grammar_calls_running: int = 0


class TokenSink(Protocol):
    """What a blocking ``generate`` needs of its sink (see :class:`Sink`)."""

    def prompt_processed(self, prompt_tokens: int, cached_tokens: int = 0) -> None:
        """Report the prompt's token count once it is known (and how many of
        them came from the engine's prefix cache, if it knows). Never blocks."""

    def emit(self, text: str, tokens: int = 1, logprobs: tuple[TokenLogprob, ...] = ()) -> None:
        """Hand over final text for ``tokens`` generated tokens; block while full.

        ``text`` may be empty when a token's bytes are held back (a partial
        character or a possible stop string); the token still counts.
        ``logprobs``: one entry per token, when the request asked for them
        (:attr:`GenerationRequest.logprobs`); an engine passes them only then. Raises
        :class:`~wsserver.errors.GenerationCancelled` on cancel. Never call
        it on the event loop.
        """


class Sink(TokenSink, Protocol):
    """One request's bounded channel, as an engine sees it. Thread-safe."""

    def offer(self, text: str, tokens: int = 1, logprobs: tuple[TokenLogprob, ...] = ()) -> bool:
        """Hand over text without blocking. ``False``: the channel is full (or
        the request was cancelled) and nothing was taken; try again after
        :meth:`when_room`."""

    def offer_call(self, part: CallPart, tokens: int = 0) -> bool:
        """Hand over a part of a tool call the engine parsed itself (an
        upstream's ``tool_calls``), as :meth:`offer` hands over text: after
        the text before it, never blocking, ``False`` when full. ``part``
        carries the engine's own call index, the arguments' text it adds
        (a few KiB at most: :data:`~wsserver.core.call_parts.FRAGMENT_CHARS`), and
        on a call's first part its ``name`` and ``id`` (if it has one). Only
        an engine whose :meth:`Backend.output_format` says ``relay`` calls it."""

    def when_room(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` once, from any thread, when :meth:`offer` may
        succeed again or the request is cancelled — at once if that is already
        so. Must be quick and must not raise."""

    def end(self, outcome: Outcome) -> None:
        """The request ended. Never blocks (an end always fits); dropped after a cancel."""


class Backend(abc.ABC):
    """An engine that streams completions (see the module docstring)."""

    #: Called with the model's name when an engine learns it after ``load``
    #: (the openai backend, when its upstreams start later than wsserver).
    on_model: Callable[[str], None] | None = None

    #: Shown to clients in ``hello``.
    model_name: str = "unknown"
    #: How many requests may run at once (contexts, sequences, streams); 0 = no limit.
    slots: int = 0
    #: How many requests may wait for a slot before ``overloaded``.
    max_waiting: int = 64
    #: The stage options (:data:`wsserver.core.sampling.NEUTRAL`'s names) this
    #: engine honours; any other given a value that matters is refused.
    honours: frozenset[str] = frozenset()

    def load(self) -> None:
        """Load the model. Blocking; called once on a worker thread."""
        return None  # a backend with nothing to load needs no override

    def close(self) -> None:
        """Release the model: at shutdown, or to unload it (the registry calls it
        only when no request runs on it; ``load`` may follow again)."""
        return None

    def served_models(self) -> dict[str, bool] | None:
        """The models this engine chooses among itself, by the request's
        ``model`` (:attr:`GenerationRequest.model`), each with whether it can
        be served now; ``None``: one model, :attr:`model_name`; ``{}``: it
        chooses itself but knows none yet (any name is passed to it, and it
        refuses what it cannot serve). Called on the event loop (the openai
        backend: what its upstreams list)."""
        return None

    def memory_estimate(self) -> int:
        """The bytes ``load`` will take (weights + KV cache), for the memory
        budget of several models; called on a worker thread before ``load``.
        Raises :class:`~wsserver.errors.ModelLoadError` for a file that cannot be
        a model. 0: nothing worth counting (an engine whose model lives elsewhere)."""
        return 0

    def model_file(self) -> Path | None:
        """The GGUF the engine serves, for what its header says (Ollama's
        ``/api/show``); ``None``: no local file (an upstream's model). May
        block (the default model is assembled once): call it off the loop."""
        return None

    def has_chat_template(self) -> bool | None:
        """Whether the loaded model has a chat template (``False``: a base model,
        its chats rendered as plain text), for ``hello`` and ``GET /v1/models``;
        ``None``: an engine without the notion (not said). Quick, on the loop."""
        return None

    def input_modalities(self) -> tuple[str, ...] | None:
        """What the loaded model takes in (``"text"``, ``"image"``, ``"audio"``),
        for ``hello`` and ``GET /v1/models``; ``None``: not said. Quick, on the loop."""
        return None

    def check(self, frame: Generate) -> None:
        """Refuse, before it starts, a request this engine cannot serve as asked.

        Called for every ``generate`` (and a ``restart``'s overrides) before
        the request is accepted — on the event loop, or on a worker thread for
        a long input or when :meth:`check_blocks` says so; raises
        :class:`~wsserver.errors.ProtocolError`: ``unsupported_option`` for a
        stage option (:data:`wsserver.core.sampling.NEUTRAL`) given a value that
        matters and not in :attr:`honours`; an engine's override adds its own
        checks (``bad_request``: a grammar that does not compile, a token
        outside the vocabulary; images to a model that takes none). Quick or
        cached — or :meth:`check_blocks` says so: a worker thread runs it."""
        check_images(frame, self.input_modalities(), self.model_name)
        for name in sorted(options_asked(frame) - self.honours):
            raise ProtocolError(
                "unsupported_option",
                f"'{name}' is not supported by this server's engine ({self.model_name}); "
                "leave it out or give its neutral value",
                frame.id,
            )
        if (
            frame.reasoning_budget_tokens is not None
            and "reasoning_budget_tokens" not in self.honours
        ):
            raise ProtocolError(
                "unsupported_option",
                f"'reasoning_budget_tokens' is not supported by this server's engine "
                f"({self.model_name}): it cannot end a think block early",
                frame.id,
            )
        if frame.tool_choice == "required" and "tool_choice" not in self.honours:
            # Forcing a call takes a grammar built from the tools: refused, not hoped for.
            raise ProtocolError(
                "unsupported_option",
                "'tool_choice' \"required\" or a named function is not supported by this "
                f'server\'s engine ({self.model_name}) yet: give "auto" or "none"',
                frame.id,
            )

    def check_blocks(self, frame: Generate) -> bool:
        """Whether :meth:`check` may wait on something slow for ``frame`` (the
        llama engine: a chat template rendered in a worker process, up to its
        time bound): the server then runs it on a worker thread, whatever the
        input's size. Quick; called on the event loop."""
        return False

    def prepare_blocks(self, request: GenerationRequest) -> bool:
        """Whether :meth:`prepare` has work for ``request`` (then the server runs
        it on a worker thread once the request has its slot, before
        :meth:`output_format` and :meth:`submit`, which run on the loop).
        Quick; called on the event loop."""
        return False

    def prepare(self, request: GenerationRequest) -> GenerationRequest:
        """``request`` with what may take long worked out ahead, off the loop
        and off the engine (:attr:`GenerationRequest.prepared`): the llama
        engine renders the chat template and tokenizes the prompt here, so that
        neither the event loop nor its engine thread ever waits on a template.
        Never raises: a failure is kept for :meth:`submit` to report."""
        return request

    def count_prompt_tokens(self, request: GenerationRequest) -> int | None:
        """The prompt's token count as this engine would feed it (its chat
        template and tokenizer), or ``None`` if the engine cannot count.

        Called on a worker thread (``count_tokens`` of the Messages API), never
        inside a request; raises :class:`~wsserver.errors.ProtocolError` when
        the engine could count but not now (``overloaded``: not loaded yet) or
        not this prompt (``bad_request``: its template refused the messages).
        """
        return None

    def output_format(self, request: GenerationRequest) -> OutputFormat:
        """What ``request``'s output will look like, for the core to shape it
        (:mod:`wsserver.shaping.shaper`): whether its prompt ends inside an open think
        block (a chat template that opens it: the output starts as
        reasoning), and the syntax of the model's tool calls — written in the
        text (read from the chat template; an engine without one: ``any``),
        or ``relay`` for an engine that hands them over as parts
        (:meth:`Sink.offer_call`). Called on the event loop once per request,
        after :meth:`prepare`: quick. Engines with reasoning budgets ask it
        too (whether the block starts open)."""
        return OutputFormat()

    def upstream_stats(self) -> list[UpstreamStats]:
        """The upstream servers this engine relays, if any (``/metrics``)."""
        return []

    def unready_reason(self) -> str | None:
        """Why the loaded engine cannot serve now (``/readyz`` answers 503 with it), or None.

        For an engine whose model lives elsewhere, such as the openai backend
        while none of its upstreams is in rotation; for the llama engine, while
        it is stalled (a step has run too long). Called on the event loop, by
        ``/readyz`` and by the server's periodic probe (every
        ``server.loop_probe_ms``): must be quick. The text is shown to anyone
        who may ask ``/readyz``: no request's content or id.
        """
        return None

    def liveness(self) -> Liveness:
        """The engine's progress, for ``/metrics`` (quick, any thread)."""
        return Liveness()

    def stats(self) -> dict[str, int]:
        """The engine's counters since its model's load, by name (``/metrics``
        reads ``draft_tokens`` and ``draft_tokens_accepted``; quick, any
        thread; an engine without counters: none)."""
        return {}

    def prompt_cache(self) -> PromptCacheFigures:
        """The engine's prompt cache in host memory, for ``/metrics`` (quick,
        any thread; an engine without one: zeros)."""
        return PromptCacheFigures()

    @abc.abstractmethod
    def submit(
        self, request: GenerationRequest, *, slot: int, sink: Sink, cancel: CancelEvent
    ) -> Submission:
        """Start ``request`` on ``slot``; called on the event loop, returns at once."""

    def embeddings(self) -> EmbedDoor | None:
        """The loaded model's embedding door (:mod:`.embed_door`), or None:
        it embeds nothing (this default; the request is refused by name)."""
        return None
