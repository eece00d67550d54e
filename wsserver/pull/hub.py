"""Fetching a reference's files from the Hugging Face Hub into its cache (blocking I/O).

Theory of operation
-------------------
Every byte comes through ``huggingface_hub``, the Hub's own client: the
listing (``HfApi.model_info(files_metadata=True)``: each file's size and
sha256), each file's metadata (``get_hf_file_metadata``: the ``HEAD`` that
follows the Hub's redirects and reads ``X-Linked-Etag``, ``X-Linked-Size``
and ``X-Repo-Commit``), the body (``http_get``, with its retries and its
``Range`` resumption), and the snapshot's pointer (``hf_hub_download``,
once the blob is in place). Files land in the Hub's cache layout
(``models--org--repo/blobs/<sha256>``, ``snapshots/<commit>/<path>``,
``refs/<branch>``), so a file another tool downloaded is reused, and ours are
theirs to use. ``HF_ENDPOINT``, ``HF_TOKEN``, ``HF_HUB_CACHE``/``HF_HOME`` and
``HF_HUB_OFFLINE`` are honoured (the first, third and last through
:class:`HubSettings`, resolved by the configuration; the token by
``huggingface_hub`` itself).

What this module adds to ``hf_hub_download``, which since huggingface_hub 2.0
downloads into a temporary file of its own that it deletes on any failure
and checks only the size:

* **Resume across interruptions.** A file is written to
  ``blobs/<sha256>.incomplete`` — the name earlier huggingface_hub versions
  resumed from — under the same lock file huggingface_hub takes for that blob
  (``.locks/models--org--repo/<sha256>.lock``), so two processes never write
  one file. A cancelled or broken download leaves it there; the next pull
  hashes what is there and asks only for the rest (``Range``).
* **Verification before use.** Bytes are hashed as they are written; the
  file becomes ``blobs/<sha256>`` (an atomic rename) only if its digest is the
  one the Hub listed — the sha256 of an LFS file, the git blob id of a file
  kept in git — and the ``HEAD``'s ``X-Linked-Etag`` agrees. A mismatch
  deletes the partial file: nothing half-written or wrong is ever at a name
  a loader reads. A file already in the cache is hashed too, once per
  process (:class:`Hub` remembers it by path, size and mtime).
* **Disk space and a size cap, checked before the first byte.** The bytes
  still missing must fit in the cache's file system, and the whole pull under
  ``models.max_download_bytes``; a disk that fills anyway (``ENOSPC``) ends the
  pull with ``disk_full`` and its partial file deleted.
* **Cancel.** A :class:`threading.Event` is checked at every chunk written;
  the download then stops within one chunk (or, while no byte arrives, when
  the read times out), keeping its partial file for a later resume.
  ``http_get`` reads in chunks of ``huggingface_hub.constants.DOWNLOAD_CHUNK_SIZE``
  (10 MiB): a cancel, and a progress report, would wait for 10 MiB — ten
  seconds at 1 MB/s. It is the one knob of the library this module turns, to
  :data:`DOWNLOAD_CHUNK` (1 MiB; a test checks the knob is still there).
* **Offline.** With ``offline`` the Hub is never asked: the reference is
  resolved from the cache's ``refs`` and ``snapshots``, and its files are
  verified against their blob names (for an LFS file, its sha256).

Every third-party exception is translated here into a
:class:`~wsserver.errors.PullError` with a wire code.

Downloads always take the plain HTTP path, also for files the Hub keeps in
Xet storage (the Hub serves those over HTTP too): the guarantees above are
then the same for every file and tested; Xet's chunk-level deduplication is
not used (docs/models.md).
"""

from __future__ import annotations

import logging
import re
import shutil
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from ..errors import PullError
from .blob import (
    DOWNLOAD_CHUNK,
    PullCancelled,
    cached_files,
    digest_of,
    download,
    hash_prefix,
    is_digest,
    repo_folder,
    translate,
    write_ref,
)
from .progress import Progress, PullStatus
from .reference import Plan, Reference, RemoteFile, parse_reference, plan_files

__all__ = ["DEFAULT_ENDPOINT", "DOWNLOAD_CHUNK", "Hub", "HubSettings", "PullCancelled", "Pulled"]

log = logging.getLogger("wsserver.pull")

DEFAULT_ENDPOINT: Final = "https://huggingface.co"
_COMMIT_RE: Final = re.compile(r"[0-9a-f]{40}")

Report = Callable[[Progress], None]


@dataclass(frozen=True, slots=True)
class HubSettings:
    """Where the Hub is, where its files go, and how much may come."""

    #: The Hub's address (``HF_ENDPOINT``).
    endpoint: str = DEFAULT_ENDPOINT
    #: The Hub's cache (``HF_HUB_CACHE``; ``None``: huggingface_hub's default).
    cache_dir: Path | None = None
    #: Never ask the Hub: only what is cached (``HF_HUB_OFFLINE``).
    offline: bool = False
    #: ``None``: huggingface_hub's own (``HF_TOKEN``, or a stored ``hf auth login``).
    token: str | None = None
    #: The largest pull, every file of it together (0: no limit).
    max_download_bytes: int = 0

    def cache(self) -> Path:
        if self.cache_dir is not None:
            return self.cache_dir
        from huggingface_hub import constants

        return Path(constants.HF_HUB_CACHE)

    @classmethod
    def from_config(cls, models: Any) -> HubSettings:
        """From the ``[models]`` section (:class:`wsserver.config.ModelsConfig`)."""
        return cls(
            endpoint=(models.endpoint or DEFAULT_ENDPOINT).rstrip("/"),
            cache_dir=Path(models.cache_dir).expanduser() if models.cache_dir else None,
            offline=models.offline,
            max_download_bytes=models.max_download_bytes,
        )


@dataclass(frozen=True, slots=True)
class Pulled:
    """A reference's files, in the cache and verified."""

    plan: Plan
    #: Each part's path in the cache's snapshot (load the first: a split
    #: GGUF's loader finds the others beside it by name).
    parts: tuple[Path, ...]
    #: The multimodal projector, if the repository has one.
    mmproj: Path | None
    #: Bytes that came over the network this time (0: all were cached).
    downloaded: int

    @property
    def model_path(self) -> Path:
        return self.parts[0]


class Hub:
    """Resolves references and fetches their files (blocking: call it from a
    worker thread). One per process is enough; it remembers which cached files
    it has verified, and serialises writers of one blob within the process."""

    def __init__(
        self,
        settings: HubSettings,
        *,
        disk_free: Callable[[Path], int] | None = None,
    ) -> None:
        self.settings = settings
        #: The free bytes of the file system holding a path (a test's seam).
        self._disk_free = disk_free or (lambda path: shutil.disk_usage(path).free)
        self._verified: set[tuple[str, int, int]] = set()
        self._guard = threading.Lock()
        self._blob_locks: dict[str, threading.Lock] = {}

    # ------------------------------------------------------------ resolving

    def resolve(self, reference: Reference | str) -> Plan:
        """Which files ``reference`` means (asks the Hub unless offline)."""
        ref = parse_reference(reference) if isinstance(reference, str) else reference
        if self.settings.offline:
            return self.resolve_cached(ref)
        from huggingface_hub import HfApi

        api = HfApi(endpoint=self.settings.endpoint, token=self.settings.token)
        try:
            info = api.model_info(ref.repo, revision=ref.revision, files_metadata=True)
        except Exception as exc:
            error = translate(exc, ref.text)
            if error.code != "hub_unreachable":
                raise error from None
            log.warning("%s; looking in the cache", error.message)
            try:
                return self.resolve_cached(ref)
            except PullError:
                raise error from None
        if not isinstance(info.sha, str) or not _COMMIT_RE.fullmatch(info.sha):
            raise PullError("hub_error", f"the Hub gave {ref.repo} no usable commit ({info.sha!r})")
        files = [
            RemoteFile(
                path=s.rfilename,
                size=(s.lfs.size if s.lfs is not None else s.size) or 0,
                sha256=s.lfs.sha256 if s.lfs is not None else None,
                git_oid=s.blob_id if s.lfs is None else None,
            )
            for s in info.siblings or ()
        ]
        return plan_files(ref, files, info.sha)

    def resolve_cached(self, ref: Reference) -> Plan:
        """Resolve ``ref`` from the cache alone (offline)."""
        storage = self.settings.cache() / repo_folder(ref.repo)
        revision = ref.revision or "main"
        commit: str | None = revision if _COMMIT_RE.fullmatch(revision) else None
        if commit is None:
            ref_file = storage / "refs" / revision
            try:
                commit = ref_file.read_text().strip()
            except OSError:
                raise PullError(
                    "hub_unreachable",
                    f"{ref.text} is not in the cache ({storage}) and the Hub is not asked "
                    "(offline): pull it once while online",
                ) from None
        snapshot = storage / "snapshots" / commit
        files = list(cached_files(snapshot))
        try:
            plan = plan_files(ref, files, commit)
        except PullError as exc:
            raise PullError(
                "hub_unreachable", f"offline, and not all of it is cached: {exc.message}"
            ) from None
        return plan

    # ------------------------------------------------------------ fetching

    def pull(
        self,
        reference: Reference | str,
        *,
        report: Report = lambda progress: None,
        cancel: threading.Event | None = None,
    ) -> Pulled:
        """Resolve and fetch ``reference``: its files cached and verified."""
        report(Progress("resolving"))
        plan = self.resolve(reference)
        return self.fetch(plan, report=report, cancel=cancel or threading.Event())

    def fetch(self, plan: Plan, *, report: Report, cancel: threading.Event) -> Pulled:
        """Bring ``plan``'s files into the cache, verified; their snapshot paths."""
        settings = self.settings
        ref = plan.reference
        total = plan.total_bytes
        cap = settings.max_download_bytes
        if cap and total > cap:
            raise PullError(
                "download_too_large",
                f"{ref.text} is {total:,} bytes ({', '.join(f.path for f in plan.files)}), "
                f"more than models.max_download_bytes ({cap:,})",
            )
        storage = settings.cache() / repo_folder(ref.repo)
        blobs = storage / "blobs"
        missing = 0
        for file in plan.files:
            blob = self._blob_path(blobs, file)
            if blob is None or not blob.exists():
                partial = blob.with_name(blob.name + ".incomplete") if blob else None
                have = partial.stat().st_size if partial is not None and partial.exists() else 0
                missing += max(0, file.size - have)
        if missing and settings.offline:
            raise PullError(
                "hub_unreachable",
                f"offline, and {ref.text} is not all in the cache ({missing:,} bytes missing)",
            )
        if missing:
            self._check_space(blobs, missing)
        done = 0
        downloaded = 0
        paths: list[Path] = []
        for file in plan.files:
            if cancel.is_set():
                raise PullCancelled()

            def progress(
                status: PullStatus, completed: int, path: str = file.path, base: int = done
            ) -> None:
                report(Progress(status, base + completed, total, path))

            fetched = self._fetch_file(plan, storage, file, progress, cancel)
            downloaded += fetched
            done += file.size
            paths.append(self._pointer(plan, storage, file))
        report(Progress("done", total, total))
        parts = tuple(paths[: len(plan.parts)])
        mmproj = paths[len(plan.parts)] if plan.mmproj is not None else None
        return Pulled(plan=plan, parts=parts, mmproj=mmproj, downloaded=downloaded)

    def _blob_path(self, blobs: Path, file: RemoteFile) -> Path | None:
        digest = digest_of(file)
        return blobs / digest if digest else None

    def _check_space(self, blobs: Path, need: int) -> None:
        probe = blobs
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        try:
            free = self._disk_free(probe)
        except OSError:
            return  # cannot tell: the write will say (ENOSPC)
        if need > free:
            raise PullError(
                "disk_full",
                f"not enough disk space in {blobs}: the download needs {need:,} bytes "
                f"more, {free:,} are free (set HF_HUB_CACHE or models.cache_dir elsewhere, "
                "or free some: wsserver models --remove)",
            )

    def _fetch_file(
        self,
        plan: Plan,
        storage: Path,
        file: RemoteFile,
        progress: Callable[[PullStatus, int], None],
        cancel: threading.Event,
    ) -> int:
        """Make ``blobs/<digest>`` hold ``file``, verified. Bytes downloaded."""
        blobs = storage / "blobs"
        blob = self._blob_path(blobs, file)
        if blob is not None and blob.exists():
            progress("checking", 0)
            self._verify_cached(blob, file, cancel, progress)
            return 0
        if self.settings.offline:
            raise PullError("hub_unreachable", f"offline, and {file.path} is not cached")
        metadata = self._metadata(plan, file)
        etag = metadata.etag
        expected = digest_of(file)
        if expected is not None and etag != expected:
            raise PullError(
                "hub_error",
                f"the Hub lists {file.path} with digest {expected} but serves {etag}: "
                "the repository may be changing; try again",
            )
        if not etag or not is_digest(etag):
            raise PullError("hub_error", f"the Hub gave {file.path} no usable digest ({etag!r})")
        if metadata.size is not None and metadata.size != file.size:
            raise PullError(
                "hub_error",
                f"the Hub lists {file.path} as {file.size:,} bytes but serves {metadata.size:,}",
            )
        blob = blobs / etag
        with self._blob_lock(storage, etag, cancel):
            if blob.exists():  # another process (or pull) finished it meanwhile
                progress("checking", 0)
                self._verify_cached(blob, file, cancel, progress)
                return 0
            downloaded = download(
                metadata,
                blob,
                file,
                progress,
                cancel,
                token=self.settings.token,
                endpoint=self.settings.endpoint,
            )
            self._remember(blob)
            return downloaded

    def _metadata(self, plan: Plan, file: RemoteFile) -> Any:
        from huggingface_hub import get_hf_file_metadata, hf_hub_url

        ref = plan.reference
        url = hf_hub_url(
            ref.repo,
            file.path,
            revision=plan.commit or ref.revision,
            endpoint=self.settings.endpoint,
        )
        try:
            metadata = get_hf_file_metadata(
                url, token=self.settings.token, endpoint=self.settings.endpoint
            )
        except Exception as exc:
            raise translate(exc, f"{ref.repo}/{file.path}") from None
        return metadata

    @contextmanager
    def _blob_lock(self, storage: Path, etag: str, cancel: threading.Event) -> Iterator[None]:
        """This blob's writer lock: in this process, and across processes with
        the lock file huggingface_hub itself takes for it."""
        from filelock import FileLock, Timeout

        lock_path = storage.parent / ".locks" / storage.name / f"{etag}.lock"
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        with self._guard:
            local = self._blob_locks.setdefault(str(lock_path), threading.Lock())
        while not local.acquire(timeout=0.25):
            if cancel.is_set():
                raise PullCancelled()
        try:
            file_lock = FileLock(str(lock_path))
            while True:
                try:
                    file_lock.acquire(timeout=0.25)
                    break
                except Timeout:
                    if cancel.is_set():
                        raise PullCancelled() from None
            try:
                yield
            finally:
                file_lock.release()
        finally:
            local.release()

    def _verify_cached(
        self,
        blob: Path,
        file: RemoteFile,
        cancel: threading.Event,
        progress: Callable[[PullStatus, int], None],
    ) -> None:
        if self._known(blob):
            return
        stat = blob.stat()
        if stat.st_size != file.size:
            raise PullError(
                "verification_failed",
                f"{file.path}: the cached {blob} is {stat.st_size:,} bytes, the Hub's file "
                f"{file.size:,}; remove it (wsserver models --remove) and pull again",
            )
        with open(blob, "rb") as handle:
            digest = hash_prefix(handle, file, file.size, cancel, progress).hexdigest()
        if digest != digest_of(file):
            raise PullError(
                "verification_failed",
                f"{file.path}: the cached {blob} does not match the Hub's digest; remove it "
                "(wsserver models --remove) and pull again",
            )
        self._remember(blob)

    def _known(self, blob: Path) -> bool:
        stat = blob.stat()
        with self._guard:
            return (str(blob.resolve()), stat.st_size, stat.st_mtime_ns) in self._verified

    def _remember(self, blob: Path) -> None:
        stat = blob.stat()
        with self._guard:
            self._verified.add((str(blob.resolve()), stat.st_size, stat.st_mtime_ns))

    def _pointer(self, plan: Plan, storage: Path, file: RemoteFile) -> Path:
        """The file's path in the snapshot, created by huggingface_hub itself
        (the blob is in place and verified, so nothing more is downloaded)."""
        ref = plan.reference
        commit = plan.commit
        assert commit is not None
        pointer = storage / "snapshots" / commit / file.path
        if not pointer.exists():
            if self.settings.offline:
                raise PullError("hub_unreachable", f"offline, and {file.path} is not cached")
            from huggingface_hub import hf_hub_download
            from huggingface_hub.utils import silent_tqdm  # type: ignore[attr-defined]

            try:
                path = hf_hub_download(
                    ref.repo,
                    file.path,
                    revision=commit,
                    cache_dir=self.settings.cache(),
                    endpoint=self.settings.endpoint,
                    token=self.settings.token,
                    tqdm_class=silent_tqdm,
                )
            except Exception as exc:
                raise translate(exc, f"{ref.repo}/{file.path}") from None
            pointer = Path(str(path))
        blob = self._blob_path(storage / "blobs", file)
        if blob is not None and pointer.resolve() != blob.resolve():
            # Not the blob this pull verified (cannot happen unless the cache
            # was changed under us): verify what the pointer leads to.
            self._verify_cached(pointer.resolve(), file, threading.Event(), lambda *a: None)
        revision = ref.revision if ref.revision is not None else "main"
        if revision != commit:
            try:
                write_ref(storage, revision, commit)
            except OSError as exc:  # a convenience for offline use, not the pull
                log.warning("cannot record %s's %s as %s: %s", ref.repo, revision, commit, exc)
        return pointer
