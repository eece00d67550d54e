"""What the asyncio and the sync client are, apart from moving bytes.

Both clients are a :class:`ClientBase`: the options (URL, token, origin,
resumability, the reconnect budget, ``on_reconnect``), the connection's
:class:`~wsserver_client.core.RequestTable` with the reconnect policy
(:mod:`wsserver_client.reconnect`), and the calls that only build requests
(:meth:`ClientBase.generate`, :meth:`ClientBase.restart`). Connecting,
sending, receiving and waiting are each client's own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any, Generic, Literal, Self, TypeVar

from wsserver.core.protocol import Error, Hello

from .core import EmbedRequest, PullRequest, Request, RequestTable
from .images import pack_images
from .reconnect import ReconnectPolicy

__all__ = ["ClientBase"]

S = TypeVar("S", bound=Request)

#: ``tool_choice``: "auto", "none", "required", or
#: ``{"type": "function", "function": {"name": …}}``.
ToolChoice = Literal["auto", "none", "required"] | dict[str, Any]


class ClientBase(Generic[S]):
    """The options and the requests of one client; ``S`` is its stream class.

    ``token`` is sent as a bearer token, ``origin`` as the Origin header.
    ``resumable=True`` makes every request resumable (a request's own
    ``resumable=`` wins): a lost connection is then reconnected and the
    request resumed, within ``reconnect_timeout`` seconds of the loss (the
    policy of :mod:`wsserver_client.reconnect`); ``on_reconnect(client)`` is
    called after each such reconnect. Other keyword arguments go to websockets'
    ``connect`` (``open_timeout``, ``max_size``, …).
    """

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        origin: str | None = None,
        resumable: bool = False,
        model: str | None = None,
        reconnect_timeout: float = 30.0,
        on_reconnect: Callable[[Self], None] | None = None,
        **connect_kwargs: Any,
    ) -> None:
        self.url = url
        self.token = token
        #: Ask for every request to be resumable (a request's own
        #: ``resumable=`` wins).
        self.resumable = resumable
        #: The model every ``generate`` asks for unless it names one (None:
        #: the server's default; ``hello.models`` lists them).
        self.model = model
        self.on_reconnect = on_reconnect
        #: Times the connection was lost and the live requests resumed.
        self.reconnects = 0
        self._closing = False
        self._connect_kwargs = connect_kwargs
        if origin is not None:
            self._connect_kwargs["origin"] = origin
        self._headers = dict(self._connect_kwargs.pop("additional_headers", {}) or {})
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self.requests: RequestTable[S] = RequestTable(ReconnectPolicy(timeout_s=reconnect_timeout))
        self._init_io()

    def _init_io(self) -> None:
        """Set up the client's own I/O state (the last step of ``__init__``)."""

    @property
    def reconnect_timeout(self) -> float:
        """How long after a lost connection a resumable request may take to
        be resumed (reconnecting, and asking again when the server refuses);
        then it fails."""
        return self.requests.policy.timeout_s

    @reconnect_timeout.setter
    def reconnect_timeout(self, seconds: float) -> None:
        self.requests.policy = replace(self.requests.policy, timeout_s=seconds)

    @property
    def hello(self) -> Hello | None:
        """The server's ``hello`` (model, limits), once connected."""
        return self.requests.hello

    @property
    def errors(self) -> list[Error]:
        """``error`` frames about no live request."""
        return self.requests.errors

    def new_id(self) -> str:
        return self.requests.new_id()

    def generate(
        self,
        prompt: str | None = None,
        *,
        messages: list[dict[str, Any]] | None = None,
        id: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        tool_choice: ToolChoice | None = None,
        parallel_tool_calls: bool | None = None,
        reasoning_format: Literal["none", "auto"] | None = None,
        reasoning_budget_tokens: int | None = None,
        model: str | None = None,
        **params: Any,
    ) -> S:
        """A request; iterate the returned stream for its text, or its
        :meth:`events` for the reasoning and tool calls too.

        ``tools`` (OpenAI's function tools), ``tool_choice``,
        ``parallel_tool_calls``, ``reasoning_format`` and
        ``reasoning_budget_tokens`` (at most that many tokens of thought) go to the server as
        given (docs/protocol.md, ``generate``), like every other keyword
        argument; one left at ``None`` is not sent (the server's default).
        ``model``: one of ``hello.models``' names (default: the client's
        ``model``, else the server's default model); ``done.model`` says which
        answered.

        A user message may carry ``images``: file paths or the images' bytes
        (PNG, JPEG, GIF, BMP), read before the message's text
        (:mod:`wsserver_client.images`); they go ahead of the request as
        uploads in binary frames when the server takes them, else as base64.
        """
        chat_options = {
            "tools": tools,
            "tool_choice": tool_choice,
            "parallel_tool_calls": parallel_tool_calls,
            "reasoning_format": reasoning_format,
            "reasoning_budget_tokens": reasoning_budget_tokens,
        }
        params.update({k: v for k, v in chat_options.items() if v is not None})
        if self.resumable and params.get("n", 1) == 1:  # several choices are not resumable
            params.setdefault("resumable", True)
        model = model if model is not None else self.model
        if model is not None:
            params["model"] = model
        request_id, frame = self.requests.generate_frame(prompt, messages, id, params)
        return self.requests.add(self._with_images(self._stream(request_id, frame)))

    def restart(self, old: str | S, *, new_id: str | None = None, **overrides: Any) -> S:
        """Regenerate: cancel ``old`` (a stream or its ID) if it runs, then run
        its input again with ``overrides`` (on its model, unless they give
        ``model``; ``messages`` may carry images, as :meth:`generate`'s)."""
        if self.resumable:
            overrides.setdefault("resumable", True)
        request_id, frame = self.requests.restart_frame(old, new_id, overrides)
        return self.requests.add(self._with_images(self._stream(request_id, frame)))

    def _with_images(self, stream: S) -> S:
        """``stream``'s messages with their images in the wire's shape, and
        its uploads to send before its frame."""
        frame = stream.frame
        if frame.get("messages"):
            hello = self.requests.hello
            messages, stream.uploads = pack_images(
                frame["messages"], hello.limits if hello else None, self.requests.new_upload_id
            )
            frame["messages"] = messages
        return stream

    def pull(self, reference: str, *, id: str | None = None) -> Any:
        """Download a model from the Hugging Face Hub onto the server, where it
        allows that (``hello.pull``; docs/models.md): iterate the returned pull
        for its progress, take its ``result()`` (the ``pull_done`` frame:
        ``complete`` with the served ``model``, ``cancelled`` or ``error``), or
        ``cancel()`` it. A refused pull raises :class:`GenerationError`
        (``pull_not_allowed``, ``bad_reference``, ``busy`` …), as does a lost
        connection (``connection_lost``: a pull is not resumed)."""
        request_id, frame = self.requests.pull_frame(reference, id)
        pull = self._pull(request_id, frame)
        self.requests.add_pull(pull)
        return pull

    def _embed_request(
        self, input: Any, model: str | None, request_id: str | None
    ) -> tuple[EmbedRequest, dict[str, Any]]:
        """A new ``embed`` (registered, not yet sent) and its frame: ``input``
        in OpenAI's shapes (a string, strings, token ids, token-id arrays),
        on ``model`` (``None``: the default) — docs/embeddings.md."""
        request_id, frame = self.requests.embed_frame(input, model, request_id)
        embed = self._new_embed(request_id, frame)
        self.requests.add_embed(embed)
        return embed, frame

    def _new_embed(self, request_id: str, frame: dict[str, Any]) -> EmbedRequest:
        """The client's embed for an ``embed`` frame (an I/O layer adds its wake-up)."""
        return EmbedRequest(request_id, frame)

    def _pull(self, request_id: str, frame: dict[str, Any]) -> PullRequest:
        """The client's pull for a ``pull`` frame (not yet sent)."""
        raise NotImplementedError

    def _stream(self, request_id: str, frame: dict[str, Any]) -> S:
        """The client's stream for a request frame (not yet sent)."""
        raise NotImplementedError

    def _reconnected(self: Self) -> None:
        """A reconnect succeeded and the kept requests were resumed."""
        self.reconnects += 1
        if self.on_reconnect is not None:
            self.on_reconnect(self)
