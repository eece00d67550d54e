"""An imitation of the Hugging Face Hub's endpoints that ``huggingface_hub`` uses.

Served on 127.0.0.1 by a thread of its own (blocking pulls on worker threads
and asyncio servers in the test's loop both reach it):

* ``GET /api/models/{org}/{repo}[/revision/{rev}]?blobs=true`` — the model
  info with every file's size, git blob id and, for LFS files, ``lfs.sha256``
  (what ``HfApi.model_info(files_metadata=True)`` reads);
* ``GET /api/models/{org}/{repo}/tree/{rev}`` — the file tree (``list_repo_tree``);
* ``HEAD``/``GET /{org}/{repo}/resolve/{rev}/{path}`` — for an LFS file a 302
  to the "CDN" (``http://localhost:PORT/cdn/{sha256}``: another host name, as
  the real CDN is, so the client drops its token there) with ``X-Repo-Commit``,
  ``X-Linked-Etag`` (the sha256) and ``X-Linked-Size``; for a file kept in git
  a 200 with its git blob id as ``ETag``;
* ``GET /cdn/{sha256}`` with ``Range`` (206) — the bytes, counted.

Errors carry the Hub's ``X-Error-Code`` (``RepoNotFound``,
``RevisionNotFound``, ``EntryNotFound``, ``GatedRepo``), which
``huggingface_hub`` turns into its typed errors.

Faults for the tests: :meth:`FakeHub.hold` (send part of a file, then wait
for an event), :meth:`FakeHub.cut` (send part of a file, then drop the
connection), :meth:`FakeHub.corrupt` (one byte of a file served wrong), and
:meth:`FakeHub.gate`. Every body GET is recorded (:attr:`FakeHub.gets`:
the blob, where its range started, how many bytes went out).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

__all__ = ["FakeHub", "Get", "git_oid", "sha256"]


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def git_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class _Repo:
    files: dict[str, bytes]
    lfs: set[str]
    commit: str
    branches: dict[str, str]
    gated: bool = False


@dataclass
class Get:
    """One GET of a file's bytes."""

    digest: str
    start: int
    sent: int = 0


@dataclass
class _Fault:
    after: int
    kind: str  # "hold" or "cut"
    reached: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)
    used: bool = False


class FakeHub:
    """Start with ``with FakeHub() as hub:``; ``hub.url`` is its ``HF_ENDPOINT``."""

    def __init__(self, *, chunk: int = 4096) -> None:
        self.repos: dict[str, _Repo] = {}
        self.blobs: dict[str, bytes] = {}
        self.gets: list[Get] = []
        self.heads = 0
        self.api_calls = 0
        self.chunk = chunk
        self._faults: dict[str, _Fault] = {}
        self._corrupt: set[str] = set()
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-hub")

    # ------------------------------------------------------------ setup

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        for fault in self._faults.values():
            fault.release.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def add_repo(
        self,
        repo: str,
        files: dict[str, bytes],
        *,
        in_git: tuple[str, ...] = (),
        commit: str | None = None,
        gated: bool = False,
    ) -> str:
        """A repository at ``main``; every file in LFS unless listed in ``in_git``.
        Returns its commit."""
        if commit is None:
            seed = repo.encode() + b"".join(sha256(files[p]).encode() for p in sorted(files))
            commit = hashlib.sha1(seed).hexdigest()
        lfs = {path for path in files if path not in in_git}
        self.repos[repo] = _Repo(dict(files), lfs, commit, {"main": commit}, gated)
        for path, data in files.items():
            self.blobs[self._digest(self.repos[repo], path)] = data
        return commit

    def total_sent(self, digest: str) -> int:
        with self._lock:
            return sum(g.sent for g in self.gets if g.digest == digest)

    def wait_for_heads(self, count: int, timeout: float) -> bool:
        """Wait until ``count`` HEADs of files have been answered."""
        with self._changed:
            return self._changed.wait_for(lambda: self.heads >= count, timeout)

    def gets_of(self, digest: str) -> list[Get]:
        with self._lock:
            return [g for g in self.gets if g.digest == digest]

    # ------------------------------------------------------------ faults

    def hold(self, digest: str, after: int) -> _Fault:
        """The next GET of ``digest`` sends ``after`` bytes, sets ``reached``
        and waits for ``release`` before sending the rest."""
        fault = _Fault(after, "hold")
        self._faults[digest] = fault
        return fault

    def cut(self, digest: str, after: int) -> _Fault:
        """The next GET of ``digest`` sends ``after`` bytes and drops the connection."""
        fault = _Fault(after, "cut")
        self._faults[digest] = fault
        return fault

    def corrupt(self, digest: str) -> None:
        """``digest``'s bytes are served with one byte changed (same length)."""
        self._corrupt.add(digest)

    @contextmanager
    def held(self, digest: str, after: int) -> Iterator[_Fault]:
        fault = self.hold(digest, after)
        try:
            yield fault
        finally:
            fault.release.set()

    # ------------------------------------------------------------ serving

    def _digest(self, repo: _Repo, path: str) -> str:
        data = repo.files[path]
        return sha256(data) if path in repo.lfs else git_oid(data)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                pass

            def handle(self) -> None:
                # A client that goes away (a killed pull) is not an error here.
                with contextlib.suppress(ConnectionError):
                    super().handle()

            def do_HEAD(self) -> None:
                hub._route(self, head=True)

            def do_GET(self) -> None:
                hub._route(self, head=False)

        return Handler

    def _error(self, handler: BaseHTTPRequestHandler, status: int, code: str | None) -> None:
        body = json.dumps({"error": code or "error"}).encode()
        handler.send_response(status)
        if code:
            handler.send_header("X-Error-Code", code)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        if handler.command != "HEAD":
            handler.wfile.write(body)

    def _route(self, handler: BaseHTTPRequestHandler, *, head: bool) -> None:
        parts = urlsplit(handler.path)
        path = parts.path
        if path.startswith("/cdn/"):
            self._serve_blob(handler, path[len("/cdn/") :], head=head)
            return
        api = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/(revision|tree)/([^/]+)(/.*)?)?", path)
        if api is not None:
            self._api(
                handler, unquote(api.group(1)), api.group(2), api.group(3), parse_qs(parts.query)
            )
            return
        resolve = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        if resolve is not None:
            repo_id, rev, file = (unquote(g) for g in resolve.groups())
            self._resolve(handler, repo_id, rev, file, head=head)
            return
        self._error(handler, 404, None)

    def _repo(self, handler: BaseHTTPRequestHandler, repo_id: str, rev: str | None) -> _Repo | None:
        repo = self.repos.get(repo_id)
        if repo is None:
            self._error(handler, 401, "RepoNotFound")
            return None
        if repo.gated:
            self._error(handler, 403, "GatedRepo")
            return None
        if rev is not None and rev not in repo.branches and rev != repo.commit:
            self._error(handler, 404, "RevisionNotFound")
            return None
        return repo

    def _api(
        self,
        handler: BaseHTTPRequestHandler,
        repo_id: str,
        kind: str | None,
        rev: str | None,
        query: dict[str, list[str]],
    ) -> None:
        with self._lock:
            self.api_calls += 1
        repo = self._repo(handler, repo_id, unquote(rev) if rev else None)
        if repo is None:
            return
        entries = []
        for path in sorted(repo.files):
            data = repo.files[path]
            entry: dict[str, object] = {
                "rfilename": path,
                "size": len(data),
                "blobId": git_oid(data),
            }
            if path in repo.lfs:
                entry["lfs"] = {"size": len(data), "sha256": sha256(data), "pointerSize": 134}
            entries.append(entry)
        if kind == "tree":
            body: object = [
                {
                    "type": "file",
                    "path": e["rfilename"],
                    "size": e["size"],
                    "oid": e["blobId"],
                    **({"lfs": e["lfs"]} if "lfs" in e else {}),
                }
                for e in entries
            ]
        else:
            if "blobs" not in query:
                for e in entries:
                    for key in ("size", "blobId", "lfs"):
                        e.pop(key, None)
            body = {"id": repo_id, "sha": repo.commit, "private": False, "siblings": entries}
        data = json.dumps(body).encode()
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)

    def _resolve(
        self, handler: BaseHTTPRequestHandler, repo_id: str, rev: str, file: str, *, head: bool
    ) -> None:
        repo = self._repo(handler, repo_id, rev)
        if repo is None:
            return
        if file not in repo.files:
            self._error(handler, 404, "EntryNotFound")
            return
        data = repo.files[file]
        digest = self._digest(repo, file)
        # Counted before the answer goes out: a client that has its answer
        # must find it counted (counted after, a pull could finish first).
        self._count_head(head)
        if file in repo.lfs:
            handler.send_response(302)
            handler.send_header("Location", f"http://localhost:{self.port}/cdn/{digest}")
            handler.send_header("X-Linked-Etag", f'"{digest}"')
            handler.send_header("X-Linked-Size", str(len(data)))
            handler.send_header("ETag", f'"{git_oid(data)}"')
            handler.send_header("X-Repo-Commit", repo.commit)
            handler.send_header("Content-Length", "0")
            handler.end_headers()
            return
        handler.send_response(200)
        handler.send_header("ETag", f'"{digest}"')
        handler.send_header("X-Repo-Commit", repo.commit)
        handler.send_header("Content-Length", str(len(data)))
        handler.send_header("Accept-Ranges", "bytes")
        handler.end_headers()
        if not head:
            self._send(handler, digest, data, 0)

    def _count_head(self, head: bool) -> None:
        if head:
            with self._changed:
                self.heads += 1
                self._changed.notify_all()

    def _serve_blob(self, handler: BaseHTTPRequestHandler, digest: str, *, head: bool) -> None:
        data = self.blobs.get(digest)
        if data is None:
            self._error(handler, 404, None)
            return
        start = 0
        ranged = re.fullmatch(r"bytes=(\d+)-", handler.headers.get("Range", ""))
        if ranged is not None:
            start = int(ranged.group(1))
        if start > len(data):
            self._error(handler, 416, None)
            return
        handler.send_response(206 if ranged else 200)
        handler.send_header("Content-Length", str(len(data) - start))
        handler.send_header("Accept-Ranges", "bytes")
        handler.send_header("ETag", f'"{digest}"')
        if ranged:
            handler.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        handler.end_headers()
        if not head:
            self._send(handler, digest, data, start)

    def _send(self, handler: BaseHTTPRequestHandler, digest: str, data: bytes, start: int) -> None:
        if digest in self._corrupt:
            middle = len(data) // 2
            data = data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1 :]
        record = Get(digest, start)
        with self._lock:
            self.gets.append(record)
            fault = self._faults.get(digest)
            if fault is not None and not fault.used:
                fault.used = True
            else:
                fault = None
        position = start
        try:
            while position < len(data):
                end = min(len(data), position + self.chunk)
                if fault is not None and position < fault.after <= end:
                    end = fault.after
                handler.wfile.write(data[position:end])
                handler.wfile.flush()
                with self._lock:
                    record.sent += end - position
                position = end
                if fault is not None and position == fault.after:
                    fault.reached.set()
                    if fault.kind == "cut":
                        handler.close_connection = True
                        handler.connection.shutdown(2)
                        return
                    fault.release.wait()
        except (BrokenPipeError, ConnectionResetError):
            handler.close_connection = True
