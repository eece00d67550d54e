"""One file of a pull: downloaded, hashed as it is written, verified (blocking I/O).

The part of :mod:`.hub` that touches bytes: a file's partial download
(``blobs/<digest>.incomplete``) resumed from where it stopped, hashed as it
grows (:class:`_Writer`, the file object ``huggingface_hub``'s ``http_get``
writes to), stopped at a cancel within one chunk, and renamed into place only
when its digest is the Hub's; a full disk deletes it. Every third-party
exception becomes a :class:`~wsserver.errors.PullError` here
(:func:`translate`). And the small pieces of the cache's layout: a
repository's folder, a snapshot's files, a revision's ref. See :mod:`.hub`'s docstring for the whole pull.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import re
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO, Final
from urllib.parse import urlsplit

from ..errors import PullError
from .progress import PullStatus
from .reference import RemoteFile

__all__ = [
    "DOWNLOAD_CHUNK",
    "PullCancelled",
    "cached_files",
    "digest_of",
    "disk_error",
    "download",
    "hash_prefix",
    "is_digest",
    "is_disk_full",
    "repo_folder",
    "translate",
    "write_ref",
]

log = logging.getLogger("wsserver.pull")

_HASH_CHUNK: Final = 1 << 20
_SHA256_RE: Final = re.compile(r"[0-9a-f]{64}")
_GIT_OID_RE: Final = re.compile(r"[0-9a-f]{40}")
#: The bytes between two checks of a cancel (and two progress reports).
DOWNLOAD_CHUNK: Final = 1 << 20


class PullCancelled(Exception):
    """The pull was cancelled; what was downloaded stays for a later resume."""


def is_digest(name: str) -> bool:
    """A blob name of the Hub's cache: a sha256, or a git blob id."""
    return bool(_SHA256_RE.fullmatch(name) or _GIT_OID_RE.fullmatch(name))


def repo_folder(repo: str) -> str:
    return "models--" + repo.replace("/", "--")


def digest_of(file: RemoteFile) -> str | None:
    return file.sha256 or file.git_oid


def new_hasher(file: RemoteFile) -> Any:
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


def download(
    metadata: Any,
    blob: Path,
    file: RemoteFile,
    progress: Callable[[PullStatus, int], None],
    cancel: threading.Event,
    *,
    token: str | None,
    endpoint: str,
) -> int:
    """Download ``file`` into ``blob`` (from its ``.incomplete`` partial file
    if one is there), hashed as it is written, renamed into place only once
    verified; the bytes that came over the network."""
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
    headers = build_hf_headers(token=token)
    location = metadata.location
    if _origin(location) != _origin(endpoint):
        # A signed URL on a CDN or a storage host: the token stays on the Hub
        # (huggingface_hub does the same).
        headers.pop("authorization", None)
    try:
        # Unbuffered: a full disk is reported by the write that hit it, not
        # by a later flush (chunks are a megabyte; a buffer adds nothing).
        handle = open(partial, "r+b" if partial.exists() else "w+b", buffering=0)  # noqa: SIM115
    except OSError as exc:
        raise disk_error(exc, partial) from None
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
                return hash_prefix(handle, file, upto, cancel, progress)

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
                if is_disk_full(exc):
                    raise disk_error(exc, partial) from None
                raise translate(exc, file.path) from None
            except Exception as exc:
                raise translate(exc, file.path) from None
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
    if digest != digest_of(file) or written != file.size:
        partial.unlink(missing_ok=True)
        raise PullError(
            "verification_failed",
            f"{file.path}: the download's digest {digest} is not the Hub's "
            f"{digest_of(file)}; the file was deleted (try again)",
        )
    os.chmod(partial, 0o644)
    os.replace(partial, blob)
    log.info("%s: downloaded and verified (%d bytes)", file.path, written - resumed)
    return written - resumed


def hash_prefix(
    handle: BinaryIO,
    file: RemoteFile,
    upto: int,
    cancel: threading.Event,
    progress: Callable[[PullStatus, int], None],
) -> Any:
    """The hasher fed with the first ``upto`` bytes of ``handle``."""
    hasher = new_hasher(file)
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


def is_disk_full(exc: OSError) -> bool:
    return exc.errno in (errno.ENOSPC, errno.EDQUOT)


def disk_error(exc: OSError, path: Path) -> PullError:
    if is_disk_full(exc):
        return PullError(
            "disk_full",
            f"the disk holding {path.parent} is full; the partial download was deleted "
            "(set HF_HUB_CACHE or models.cache_dir elsewhere, or free some space)",
        )
    return PullError("hub_error", f"cannot write {path}: {exc.strerror or exc}")


def translate(exc: BaseException, what: str) -> PullError:
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


def write_ref(storage: Path, revision: str, commit: str) -> None:
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


def cached_files(snapshot: Path) -> Iterator[RemoteFile]:
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
