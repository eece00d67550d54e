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

import errno
import hashlib
import logging
import os
import re
import shutil
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Final
from urllib.parse import urlsplit

from ..errors import PullError
from .progress import Progress, PullStatus
from .reference import Plan, Reference, RemoteFile, parse_reference, plan_files

__all__ = ["DEFAULT_ENDPOINT", "DOWNLOAD_CHUNK", "Hub", "HubSettings", "PullCancelled", "Pulled"]

log = logging.getLogger("wsserver.pull")

DEFAULT_ENDPOINT: Final = "https://huggingface.co"
_SHA256_RE: Final = re.compile(r"[0-9a-f]{64}")
_GIT_OID_RE: Final = re.compile(r"[0-9a-f]{40}")
_COMMIT_RE: Final = re.compile(r"[0-9a-f]{40}")
_HASH_CHUNK: Final = 1 << 20
#: The bytes between two checks of a cancel (and two progress reports).
DOWNLOAD_CHUNK: Final = 1 << 20

Report = Callable[[Progress], None]


class PullCancelled(Exception):
    """The pull was cancelled; what was downloaded stays for a later resume."""


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


def _repo_folder(repo: str) -> str:
    return "models--" + repo.replace("/", "--")


def _digest_of(file: RemoteFile) -> str | None:
    return file.sha256 or file.git_oid


def _new_hasher(file: RemoteFile) -> Any:
    if file.sha256 is not None:
        return hashlib.sha256()
    hasher = hashlib.sha1()  # git's blob id: not a security choice, the Hub's naming
    hasher.update(f"blob {file.size}\0".encode())
    return hasher


class _Writer:
    """The file object ``http_get`` writes to: the partial file, hashed as it
    grows, reporting progress and stopping at a cancel."""

    def __init__(
        self,
        file: BinaryIO,
        hasher: Any,
        *,
        on_bytes: Callable[[int], None],
        cancel: threading.Event,
        rehash: Callable[[int], Any],
    ) -> None:
        self._file = file
        self.hasher = hasher
        self._on_bytes = on_bytes
        self._cancel = cancel
        self._rehash = rehash

    def write(self, data: bytes) -> int:
        if self._cancel.is_set():
            raise PullCancelled()
        view = memoryview(data)
        while view:  # an unbuffered file may take part of a chunk (a disk filling up)
            written = self._file.write(view)
            view = view[written or 0 :]
        self.hasher.update(data)
        self._on_bytes(self._file.tell())
        return len(data)

    def tell(self) -> int:
        return self._file.tell()

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._file.seek(offset, whence)

    def truncate(self, size: int | None = None) -> int:
        # The server ignored the Range and sent the whole file (huggingface_hub
        # then starts over): the hash starts over from what is kept.
        end = self._file.truncate(size)
        self._file.seek(end)
        self.hasher = self._rehash(end)
        return end

    def flush(self) -> None:
        self._file.flush()


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
            error = _translate(exc, ref.text)
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
        storage = self.settings.cache() / _repo_folder(ref.repo)
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
        files = list(_cached_files(snapshot))
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
        storage = settings.cache() / _repo_folder(ref.repo)
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
        digest = _digest_of(file)
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
        expected = _digest_of(file)
        if expected is not None and etag != expected:
            raise PullError(
                "hub_error",
                f"the Hub lists {file.path} with digest {expected} but serves {etag}: "
                "the repository may be changing; try again",
            )
        if not etag or not (_SHA256_RE.fullmatch(etag) or _GIT_OID_RE.fullmatch(etag)):
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
            return self._download(metadata, blob, file, progress, cancel)

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
            raise _translate(exc, f"{ref.repo}/{file.path}") from None
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

    def _download(
        self,
        metadata: Any,
        blob: Path,
        file: RemoteFile,
        progress: Callable[[PullStatus, int], None],
        cancel: threading.Event,
    ) -> int:
        from huggingface_hub import constants
        from huggingface_hub.file_download import http_get

        # Public names (in its __all__) that its lazy module hides from mypy.
        from huggingface_hub.utils import (  # type: ignore[attr-defined]
            build_hf_headers,
            silent_tqdm,
        )

        constants.DOWNLOAD_CHUNK_SIZE = DOWNLOAD_CHUNK

        partial = blob.with_name(blob.name + ".incomplete")
        blob.parent.mkdir(parents=True, exist_ok=True)
        headers = build_hf_headers(token=self.settings.token)
        location = metadata.location
        if _origin(location) != _origin(self.settings.endpoint):
            # A signed URL on a CDN or a storage host: the token stays on the Hub
            # (huggingface_hub does the same).
            headers.pop("authorization", None)
        try:
            # Unbuffered: a full disk is reported by the write that hit it, not
            # by a later flush (chunks are a megabyte; a buffer adds nothing).
            handle = open(partial, "r+b" if partial.exists() else "w+b", buffering=0)  # noqa: SIM115
        except OSError as exc:
            raise _disk_error(exc, partial) from None
        resumed = 0
        try:
            with handle:
                resumed = handle.seek(0, os.SEEK_END)
                if resumed > file.size:
                    handle.truncate(0)
                    resumed = handle.seek(0)
                if resumed:
                    log.info("%s: resuming after %d bytes", file.path, resumed)
                    progress("checking", 0)

                def rehash(upto: int) -> Any:
                    return _hash_prefix(handle, file, upto, cancel, progress)

                hasher = rehash(resumed)
                handle.seek(resumed)
                progress("downloading", resumed)
                writer = _Writer(
                    handle,
                    hasher,
                    on_bytes=lambda position: progress("downloading", position),
                    cancel=cancel,
                    rehash=rehash,
                )
                try:
                    http_get(
                        location,
                        writer,  # type: ignore[arg-type]
                        resume_size=resumed,
                        headers=headers,
                        expected_size=file.size,
                        displayed_filename=file.path,
                        tqdm_class=silent_tqdm,
                    )
                except PullCancelled:
                    log.info(
                        "%s: cancelled after %d bytes (kept for a resume)", file.path, handle.tell()
                    )
                    raise
                except OSError as exc:
                    if _is_disk_full(exc):
                        raise _disk_error(exc, partial) from None
                    raise _translate(exc, file.path) from None
                except Exception as exc:
                    raise _translate(exc, file.path) from None
                progress("verifying", handle.tell())
                handle.flush()
                os.fsync(handle.fileno())
                digest = writer.hasher.hexdigest()
                written = handle.tell()
        except PullError as error:
            # A full disk: nothing half-written is left. Anything else (the
            # network, the Hub): the bytes so far are kept for a resume, and
            # checked by their hash when it completes.
            if error.code == "disk_full":
                partial.unlink(missing_ok=True)
            raise
        if digest != _digest_of(file) or written != file.size:
            partial.unlink(missing_ok=True)
            raise PullError(
                "verification_failed",
                f"{file.path}: the download's digest {digest} is not the Hub's "
                f"{_digest_of(file)}; the file was deleted (try again)",
            )
        os.chmod(partial, 0o644)
        os.replace(partial, blob)
        self._remember(blob)
        log.info("%s: downloaded and verified (%d bytes)", file.path, written - resumed)
        return written - resumed

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
            digest = _hash_prefix(handle, file, file.size, cancel, progress).hexdigest()
        if digest != _digest_of(file):
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
                raise _translate(exc, f"{ref.repo}/{file.path}") from None
            pointer = Path(str(path))
        blob = self._blob_path(storage / "blobs", file)
        if blob is not None and pointer.resolve() != blob.resolve():
            # Not the blob this pull verified (cannot happen unless the cache
            # was changed under us): verify what the pointer leads to.
            self._verify_cached(pointer.resolve(), file, threading.Event(), lambda *a: None)
        revision = ref.revision if ref.revision is not None else "main"
        if revision != commit:
            try:
                _write_ref(storage, revision, commit)
            except OSError as exc:  # a convenience for offline use, not the pull
                log.warning("cannot record %s's %s as %s: %s", ref.repo, revision, commit, exc)
        return pointer


def _write_ref(storage: Path, revision: str, commit: str) -> None:
    """``refs/<revision>`` → ``commit``, written atomically as huggingface_hub
    writes it, so that an offline pull of the same reference finds it."""
    ref_path = storage / "refs" / revision
    try:
        if ref_path.read_text() == commit:
            return
    except OSError:
        pass
    ref_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = ref_path.with_name(f"{ref_path.name}.{os.getpid()}.tmp")
    tmp.write_text(commit)
    os.replace(tmp, ref_path)


def _cached_files(snapshot: Path) -> Iterator[RemoteFile]:
    """A snapshot's files as a listing: each pointer's blob name is its digest."""
    if not snapshot.is_dir():
        return
    for path in sorted(snapshot.rglob("*")):
        if not path.is_file():
            continue
        target = path.resolve()
        name = target.name
        yield RemoteFile(
            path=path.relative_to(snapshot).as_posix(),
            size=target.stat().st_size,
            sha256=name if _SHA256_RE.fullmatch(name) else None,
            git_oid=name if _GIT_OID_RE.fullmatch(name) else None,
        )


def _hash_prefix(
    handle: BinaryIO,
    file: RemoteFile,
    upto: int,
    cancel: threading.Event,
    progress: Callable[[PullStatus, int], None],
) -> Any:
    """The hasher fed with the first ``upto`` bytes of ``handle``."""
    hasher = _new_hasher(file)
    handle.seek(0)
    left = upto
    while left > 0:
        if cancel.is_set():
            raise PullCancelled()
        chunk = handle.read(min(_HASH_CHUNK, left))
        if not chunk:
            break
        hasher.update(chunk)
        left -= len(chunk)
        progress("checking", upto - left)
    return hasher


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urlsplit(url)
    return parts.scheme, (parts.hostname or "").lower(), parts.port


def _is_disk_full(exc: OSError) -> bool:
    return exc.errno in (errno.ENOSPC, errno.EDQUOT)


def _disk_error(exc: OSError, path: Path) -> PullError:
    if _is_disk_full(exc):
        return PullError(
            "disk_full",
            f"the disk holding {path.parent} is full; the partial download was deleted "
            "(set HF_HUB_CACHE or models.cache_dir elsewhere, or free some space)",
        )
    return PullError("hub_error", f"cannot write {path}: {exc.strerror or exc}")


def _translate(exc: BaseException, what: str) -> PullError:
    """huggingface_hub's (and its HTTP library's) exceptions → a wire code."""
    from huggingface_hub import errors as hf

    if isinstance(exc, PullError):
        return exc
    if isinstance(exc, hf.GatedRepoError):
        return PullError(
            "hub_unauthorized",
            f"{what} is gated: accept its terms on the Hub, then give a token (HF_TOKEN)",
        )
    if isinstance(exc, hf.RepositoryNotFoundError):
        return PullError(
            "hub_not_found",
            f"no repository for {what} on the Hub (a private one needs a token: HF_TOKEN)",
        )
    if isinstance(exc, hf.RevisionNotFoundError):
        return PullError("hub_not_found", f"{what}: no such revision on the Hub")
    if isinstance(exc, hf.RemoteEntryNotFoundError):
        return PullError("hub_not_found", f"{what}: no such file on the Hub")
    if isinstance(exc, hf.HfHubHTTPError):
        status = exc.response.status_code if exc.response is not None else None
        if status in (401, 403):
            return PullError("hub_unauthorized", f"{what}: the Hub refused access ({status})")
        return PullError("hub_error", f"{what}: the Hub answered {status}")
    if isinstance(exc, hf.OfflineModeIsEnabled | hf.LocalEntryNotFoundError):
        return PullError("hub_unreachable", f"{what}: offline, and not in the cache")
    import httpx2

    if isinstance(exc, httpx2.HTTPError):
        return PullError(
            "hub_unreachable", f"{what}: cannot reach the Hub: {type(exc).__name__} {exc}"
        )
    if isinstance(exc, OSError):
        return PullError("hub_error", f"{what}: {exc}")
    raise exc
