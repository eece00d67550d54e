"""A request as an engine gets it: validated, the server's defaults filled in (sans-I/O)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..core.audio_check import is_audio
from ..core.protocol import Generate, Message
from ..core.sampling import SAMPLING_FIELDS, Sampling
from ..errors import ProtocolError

__all__ = ["GenerationRequest", "check_images"]


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """A validated request with the server's defaults filled in."""

    id: str
    prompt: str | None
    messages: tuple[Message, ...] | None
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    #: The connection it came from: for log lines and thread names only.
    conn_id: str = ""
    #: The rest of the sampler chain, llama-server's defaults filled in.
    sampling: Sampling = field(default_factory=Sampling)
    #: A GBNF grammar, or a JSON Schema as JSON text, the output must match.
    grammar: str | None = None
    json_schema: str | None = None
    #: OpenAI's function tools and extra chat-template variables, as JSON text.
    tools: str | None = None
    chat_template_kwargs: str | None = None
    #: ``required`` (a call is forced; ``tool_name``: that function) or None.
    tool_choice: str | None = None
    tool_name: str | None = None
    #: At most one call when False.
    parallel_tool_calls: bool | None = None
    #: Tokens allowed inside the think block before the engine closes it
    #: (``reasoning_budget_tokens``); None: no budget.
    reasoning_budget: int | None = None
    #: Log-probabilities asked for: how many alternatives per token (0-20);
    #: ``None``: none (the engine computes nothing for them).
    logprobs: int | None = None
    #: False: no n-gram drafts for it (``speculative`` "off"; speed only,
    #: the output is the same either way: docs/llama.md, "Speculative decoding").
    speculative: bool = True
    #: The model asked for, resolved by the server (an engine that serves
    #: several, :meth:`Backend.served_models`, routes by it).
    model: str | None = None
    #: What :meth:`Backend.prepare` worked out off the loop (the engine's own
    #: type: a rendered and tokenized prompt); None until then.
    prepared: object | None = None
    #: One of several choices for one prompt (``n`` > 1: docs/openai-api.md,
    #: "Several choices"): which one (0 to ``choices - 1``), and the key its
    #: siblings share — an engine that can shares the prompt's work among
    #: them (the llama engine: :mod:`.llama_choices`). ``group`` None: alone.
    choice: int = 0
    choices: int = 1
    group: str | None = None

    @classmethod
    def from_frame(
        cls, frame: Generate, *, default_max_tokens: int, conn_id: str = ""
    ) -> GenerationRequest:
        return cls(
            id=frame.id,
            prompt=frame.prompt,
            messages=frame.messages,
            max_tokens=frame.max_tokens if frame.max_tokens is not None else default_max_tokens,
            temperature=0.8 if frame.temperature is None else frame.temperature,
            top_p=0.95 if frame.top_p is None else frame.top_p,
            top_k=40 if frame.top_k is None else frame.top_k,
            seed=frame.seed,
            stop=frame.stop,
            conn_id=conn_id,
            sampling=Sampling.from_options({k: getattr(frame, k) for k in SAMPLING_FIELDS}),
            grammar=frame.grammar,
            json_schema=frame.json_schema,
            # tool_choice "none": the model is not shown the tools (nor parsed for calls).
            tools=None if frame.tool_choice == "none" else frame.tools,
            chat_template_kwargs=frame.chat_template_kwargs,
            tool_choice="required" if frame.tool_choice == "required" else None,
            tool_name=frame.tool_name,
            parallel_tool_calls=frame.parallel_tool_calls,
            reasoning_budget=frame.reasoning_budget_tokens,
            logprobs=(frame.top_logprobs or 0) if frame.logprobs else None,
            model=frame.model,
            speculative=frame.speculative != "off",
            choice=frame.choice,
            choices=frame.n,
            group=f"{conn_id}/{frame.choice_of}" if frame.n > 1 else None,
        )


def check_images(frame: Generate, modalities: tuple[str, ...] | None, model: str) -> None:
    """Refuse a request with images, or sounds, to a model that takes none,
    naming the first (``image 0``, ``audio 0``: counted apart)."""
    if frame.messages is None:
        return
    takes = modalities or ()
    counts = {"image": 0, "audio": 0}
    for message in frame.messages:
        for data in message.images:
            kind = "audio" if is_audio(data) else "image"
            if kind not in takes:
                what, projector = (
                    ("images", "a vision") if kind == "image" else ("audio", "an audio")
                )
                raise ProtocolError(
                    "bad_request",
                    f"{kind} {counts[kind]}: model {model} takes no {what} (it is served "
                    f"without {projector} projector: docs/images.md)",
                    frame.id,
                )
            counts[kind] += 1
