"""Several choices for one prompt in the batched engine (``n`` > 1; see :mod:`.llama_engine`).

Theory of operation
-------------------
The server runs each of a request's ``n`` choices as a request of its own
(its own slot, channel and text stream: docs/openai-api.md, "Several choices"),
all carrying the same :attr:`~.request.GenerationRequest.group`. What they
share is the prompt, and the engine ingests it once:

* The first choice of a group admitted is its **source**: it is admitted as
  any request is (the prompt cache, host memory), and ingests the prompt.
* A choice admitted while the source still ingests **waits**, holding its
  slot but no sequence. When the source's last prompt token has been decoded
  and before the source samples from its logits, each waiting choice — and
  each of the group's choices that arrived at the engine meanwhile — gets a
  free sequence with the source's cells copied into it
  (``llama_memory_seq_cp``, :meth:`.PromptCache.copy`) and samples its first
  token from the same logits with its own sampler chain: reading the logits
  does not change them. From then on each choice is a sequence like any
  other: it stops on its own, its channel pauses it alone.
* A choice admitted later (the scheduler had no free slot for it earlier)
  copies the source's cells but for the prompt's last token, which it
  decodes itself: the logits it needs are gone by then. If the source has
  left, the choice is admitted as any request (and the prompt cache finds
  the cells the source left, as it finds a regenerate's).
* If the source leaves before its prompt is in (a cancel, a failure), the
  waiting choices are admitted again at once: the first becomes the source.

A cancel of the request cancels every choice (the server's); nothing here
ties one choice's end to another's.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from ..errors import BackendError
from .llama_intake import Intake
from .llama_sequences import Job

__all__ = ["Choices"]


@dataclass(eq=False)
class _Group:
    #: The choice that ingests the prompt for all of them.
    source: Job
    #: Admitted while the source ingests: no sequence yet.
    waiting: list[Job] = field(default_factory=list)
    #: The source has sampled its first token: its prompt's logits are gone.
    sampled: bool = False


class Choices:
    """The groups of choices of the engine's running requests (engine thread only)."""

    def __init__(
        self,
        intake: Intake,
        lock: threading.Condition,
        fail: Callable[..., None],
        stats: dict[str, int],
    ) -> None:
        self._intake = intake
        #: The engine's condition, which guards its submitted requests.
        self._lock = lock
        self._fail = fail
        self._stats = stats
        self._groups: dict[str, _Group] = {}

    def admit(self, job: Job) -> None:
        """Admit ``job`` (the engine's admission; raises ``BackendError`` as
        :meth:`.Intake.start` does), or hold it until its source's prompt is in."""
        key = job.request.group
        group = self._groups.get(key) if key is not None else None
        if key is None:
            self._intake.start(job)
        elif group is None:
            self._groups[key] = _Group(job)
            self._intake.start(job)
        elif not group.sampled:
            group.waiting.append(job)  # no prompt, no sequence: no step needed
        else:
            source = group.source
            assert source.seq is not None
            self._intake.start(job, source.seq, len(source.prompt) - 1)

    def fork(self, job: Job, jobs: list[Job], incoming: list[Job]) -> list[Job]:
        """``job`` is about to sample a token: if it is a source's first, the
        choices of its group that wait (and those that arrived meanwhile:
        taken from the engine's ``incoming``, added to its ``jobs``) get
        their sequences, the prompt's cells copied. Returns those to sample
        from the same logits, after ``job``."""
        key = job.request.group
        group = self._groups.get(key) if key is not None else None
        if group is None or group.source is not job or group.sampled:
            return []
        group.sampled = True
        with self._lock:
            arrived = [j for j in incoming if j.request.group == key and not j.cancelled]
            for follower in arrived:
                incoming.remove(follower)
        jobs.extend(arrived)
        forked: list[Job] = []
        assert job.seq is not None
        for follower in group.waiting + arrived:
            if follower.cancelled:
                continue  # the next step's cancels let it go
            try:
                self._intake.start(follower, job.seq, len(job.prompt))
            except BackendError as exc:
                self._fail(follower, str(exc), code=exc.code)
                continue
            if follower.fed < len(follower.prompt):
                continue  # not the same prompt after all: it ingests its own
            follower.sink.prompt_processed(len(follower.prompt), follower.stats.reused)
            self._stats["choices_forked"] += 1
            forked.append(follower)
        group.waiting.clear()
        return forked

    def left(self, job: Job) -> None:
        """``job`` leaves the engine. A source whose prompt was not in yet
        hands its waiting choices back to admission; a waiting choice leaves its group."""
        key = job.request.group
        group = self._groups.get(key) if key is not None else None
        if group is None:
            return
        if group.source is not job:
            if job in group.waiting:
                group.waiting.remove(job)
            return
        del self._groups[key]  # type: ignore[arg-type]
        for follower in group.waiting:  # each still in the engine's jobs
            if follower.cancelled:
                continue  # the next step's cancels let it go
            try:
                self.admit(follower)  # the first becomes the source
            except BackendError as exc:
                self._fail(follower, str(exc), code=exc.code)
