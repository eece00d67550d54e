"""A model reference, and which files of a repository it means (sans-I/O).

A reference names GGUF files on the Hugging Face Hub the way llama-server's
``-hf`` takes them, with an optional revision:

==================================  ==============================================
``org/repo``                        the repo's ``Q4_K_M`` GGUF, else its ``Q8_0``,
                                    else its first model GGUF (by path)
``org/repo:Q5_K_S``                 the GGUF of that quantization (case ignored)
``org/repo/path/to/file.gguf``      exactly that file
``…@revision``                      at a branch, tag or commit (default ``main``)
``hf:…``                            the same (the prefix a configuration needs,
                                    to tell a reference from a path)
==================================  ==============================================

A split GGUF (``name-00001-of-00003.gguf``) is fetched whole: every part of
the chosen file's set, and the model is loaded from the first part. A
multimodal projector (a ``*mmproj*.gguf`` in the model's folder or above) is
fetched beside it and recorded.

**A reference is untrusted input** — it may come from a WebSocket client —
and it ends up in a URL on the Hub's endpoint and in paths under the cache.
So it is parsed strictly, not cleaned: organisation and repository names as
the Hub allows them (letters, digits, ``-``, ``_``, ``.``; no ``--`` or ``..``;
at most 96 characters each), a file path of plain segments (no ``.``/``..``
segment, no leading ``/``, no backslash, ``%``, ``?``, ``#``, ``@`` or
control character) that ends in ``.gguf``, a quantization tag of letters,
digits, ``_`` and ``-``, a revision of letters, digits and ``._/-`` without
``..``. Anything else is a :class:`~wsserver.errors.PullError`
``bad_reference`` that says what is wrong, before anything is fetched.

How the file of a quantization is chosen (:func:`plan_files`) follows
llama.cpp's ``common/download.cpp``: the tag must appear in the file's path
followed by ``.`` or ``-``; files whose names say they are not a model
(``mmproj``, ``imatrix``, speculative drafts) are never chosen; of a split
set only the first part is considered. One difference: the tag must also
*start* at a separator (``-``, ``.``, ``_``, ``/``) or the path's start, so
that ``Q4_0`` does not pick ``IQ4_0``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final

from ..errors import PullError

__all__ = [
    "DEFAULT_QUANTS",
    "Plan",
    "Reference",
    "RemoteFile",
    "SplitInfo",
    "is_safe_path",
    "parse_reference",
    "plan_files",
    "split_info",
]

#: The quantizations tried, in order, when a reference names none (llama-server's).
DEFAULT_QUANTS: Final = ("Q4_K_M", "Q8_0")

PREFIX: Final = "hf:"

_NAME = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?"
_NAME_RE: Final = re.compile(_NAME)
_QUANT_RE: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
_SEGMENT_RE: Final = re.compile(r"[A-Za-z0-9_+=,()\[\]-][A-Za-z0-9._+=,()\[\] -]{0,254}")
_REVISION_RE: Final = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._/-]{0,127}")
_MAX_PATH: Final = 512
_SPLIT_RE: Final = re.compile(r"^(.+)-(\d{5})-of-(\d{5})$", re.I)
_TAG_RE: Final = re.compile(r"[-.]([A-Z0-9_]+)$", re.I)
#: Words in a GGUF's file name that say it is not a model of its own.
_NOT_A_MODEL: Final = ("mmproj", "imatrix", "mtp-", "eagle3-", "dflash-", "dspark-")


@dataclass(frozen=True, slots=True)
class Reference:
    """A parsed reference: a repository and which GGUF of it."""

    repo: str
    #: The quantization asked for (``None``: the default order).
    quant: str | None = None
    #: A file path in the repository (then ``quant`` is ``None``).
    file: str | None = None
    #: A branch, tag or commit; ``None`` is the repository's default branch.
    revision: str | None = None

    @property
    def text(self) -> str:
        """The canonical reference (without ``hf:``): parsing it gives this one back."""
        out = self.repo
        if self.file is not None:
            out += "/" + self.file
        elif self.quant is not None:
            out += ":" + self.quant
        if self.revision is not None:
            out += "@" + self.revision
        return out

    @property
    def name(self) -> str:
        """The name a server serves it under unless told another: the reference
        without its revision (``org/repo:Q4_K_M``). Fits a model name when the
        reference has no revision and is at most 128 characters long."""
        return Reference(self.repo, self.quant, self.file).text

    def __str__(self) -> str:
        return self.text


@dataclass(frozen=True, slots=True)
class RemoteFile:
    """A file of a repository, as the Hub lists it (or the cache holds it)."""

    path: str
    size: int
    #: The sha256 of its content, for a file stored with LFS (every real GGUF).
    sha256: str | None = None
    #: Its git blob id (a SHA-1 of ``blob <size>\\0`` + content): how a file
    #: stored in git itself is checked.
    git_oid: str | None = None


@dataclass(frozen=True, slots=True)
class SplitInfo:
    """What a GGUF file name says about its split set (llama.cpp's naming)."""

    #: The name without ``.gguf`` and without the split suffix.
    prefix: str
    #: The quantization tag at its end (upper case; "" when there is none).
    tag: str
    index: int = 1
    count: int = 1


@dataclass(frozen=True, slots=True)
class Plan:
    """What a reference resolves to in one revision of its repository."""

    reference: Reference
    #: The commit the files were listed at (``None``: not known, offline).
    commit: str | None
    #: The model's files: one, or every part of a split set, in order (load the first).
    parts: tuple[RemoteFile, ...]
    #: The multimodal projector beside it, if the repository has one.
    mmproj: RemoteFile | None = None

    @property
    def files(self) -> tuple[RemoteFile, ...]:
        """Everything to fetch: the parts, then the projector."""
        return self.parts + ((self.mmproj,) if self.mmproj is not None else ())

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def quant(self) -> str:
        """The chosen file's quantization tag ("" when its name has none)."""
        return split_info(self.parts[0].path).tag


def _bad(text: str, why: str) -> PullError:
    shown = text if len(text) <= 200 else text[:200] + "…"
    return PullError("bad_reference", f"{shown!r} is not a model reference: {why}")


def parse_reference(text: str) -> Reference:
    """Parse ``[hf:]org/repo[:quant | /path/file.gguf][@revision]`` strictly.

    Raises :class:`~wsserver.errors.PullError` (``bad_reference``) naming what
    is wrong; nothing is cleaned up or guessed.
    """
    if not isinstance(text, str) or not text:
        raise _bad(str(text), "give org/repo, org/repo:QUANT or org/repo/path/file.gguf")
    if len(text) > 1024:
        raise _bad(text, "it is longer than 1024 characters")
    if any(ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F for c in text):
        raise _bad(text, "it contains a control character")
    body = text[len(PREFIX) :] if text.startswith(PREFIX) else text
    if "://" in body or body.startswith(("/", "~", ".")):
        raise _bad(text, "give a Hub reference (org/repo…), not a URL or a path")
    revision: str | None = None
    if "@" in body:
        body, _, revision = body.partition("@")
        if not _REVISION_RE.fullmatch(revision) or ".." in revision or "//" in revision:
            raise _bad(
                text,
                "a revision is 1-128 characters of A-Z a-z 0-9 . _ / - "
                "(a branch, a tag or a commit), without '..'",
            )
        if revision.endswith("/"):
            raise _bad(text, "a revision does not end with '/'")
    quant: str | None = None
    parts = body.split("/")
    if len(parts) < 2:
        raise _bad(text, "give org/repo (the organisation or user, then the repository)")
    if len(parts) == 2 and ":" in parts[1]:
        parts[1], _, quant = parts[1].partition(":")
        if not _QUANT_RE.fullmatch(quant):
            raise _bad(text, "a quantization is 1-64 characters of A-Z a-z 0-9 _ - (e.g. Q4_K_M)")
    org, repo, path = parts[0], parts[1], parts[2:]
    for what, name in (("organisation", org), ("repository", repo)):
        if not _NAME_RE.fullmatch(name) or "--" in name or ".." in name:
            raise _bad(
                text,
                f"the {what} name {name[:100]!r} is not one the Hub allows (1-96 "
                "characters of A-Z a-z 0-9 - _ ., starting and ending with a letter "
                "or digit, no '--' or '..')",
            )
    if repo.lower().endswith(".git"):
        raise _bad(text, "a repository name does not end in .git")
    file: str | None = None
    if path:
        file = "/".join(path)
        if len(file) > _MAX_PATH:
            raise _bad(text, f"the file path is longer than {_MAX_PATH} characters")
        for segment in path:
            if segment in ("", ".", "..") or not _SEGMENT_RE.fullmatch(segment):
                raise _bad(
                    text,
                    f"the path segment {segment[:100]!r} is not allowed (letters, digits, "
                    "spaces and . _ + = , ( ) [ ] -; no empty, '.' or '..' segment)",
                )
        if not file.lower().endswith(".gguf"):
            raise _bad(text, "only .gguf files can be pulled")
    return Reference(repo=f"{org}/{repo}", quant=quant, file=file, revision=revision)


def is_safe_path(path: str) -> bool:
    """Whether a path the Hub *listed* can be a path under the cache: plain
    segments, none empty, ``.`` or ``..``, no backslash or control character.
    (A listing comes from the endpoint, which may be a mirror: it is input too.)"""
    if not path or len(path) > 4096 or path.startswith("/") or "\\" in path:
        return False
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in path):
        return False
    return all(segment not in ("", ".", "..") for segment in path.split("/"))


def split_info(path: str) -> SplitInfo:
    """The split set and quantization tag a GGUF's path names (llama.cpp's rules)."""
    name = path[: -len(".gguf")] if path.lower().endswith(".gguf") else path
    index = count = 1
    match = _SPLIT_RE.match(name)
    if match is not None:
        name, index, count = match.group(1), int(match.group(2)), int(match.group(3))
    tag = _TAG_RE.search(name)
    return SplitInfo(prefix=name, tag=tag.group(1).upper() if tag else "", index=index, count=count)


def _file_name(path: str) -> str:
    return path.rpartition("/")[2]


def is_model_file(path: str) -> bool:
    """A GGUF that is a model of its own (not a projector, an imatrix or a draft)."""
    name = _file_name(path).lower()
    return name.endswith(".gguf") and not any(word in name for word in _NOT_A_MODEL)


def _quant_bits(path: str) -> int:
    """The bits a quantization tag names: Q4_K_M → 4, F16 → 16 (0: none)."""
    digits = re.search(r"\d+", split_info(path).tag)
    return int(digits.group()) if digits else 0


def _matches(path: str, quant: str) -> bool:
    return re.search(rf"(?:^|[-._/]){re.escape(quant)}[.-]", path, re.I) is not None


def _first_parts(files: Iterable[RemoteFile]) -> list[RemoteFile]:
    """Model GGUFs that can be chosen: whole files and the first part of a split set."""
    return [f for f in files if is_model_file(f.path) and split_info(f.path).index == 1]


def _available(files: Sequence[RemoteFile]) -> str:
    names = sorted({f.path for f in files if f.path.lower().endswith(".gguf")})
    if not names:
        return "the repository has no .gguf file"
    shown = ", ".join(names[:12]) + (f" and {len(names) - 12} more" if len(names) > 12 else "")
    return f"its GGUF files: {shown}"


def plan_files(reference: Reference, files: Sequence[RemoteFile], commit: str | None) -> Plan:
    """The files ``reference`` means among ``files`` (one revision's listing).

    Raises :class:`~wsserver.errors.PullError` ``hub_not_found`` when the
    repository has no such file or quantization (the message lists its GGUFs).
    """
    ordered = sorted((f for f in files if is_safe_path(f.path)), key=lambda f: f.path)
    where = reference.repo + (f"@{reference.revision}" if reference.revision else "")
    primary: RemoteFile | None = None
    if reference.file is not None:
        exact = [f for f in ordered if f.path == reference.file]
        folded = [f for f in ordered if f.path.lower() == reference.file.lower()]
        found = exact or folded
        if not found:
            raise PullError(
                "hub_not_found", f"{where} has no file {reference.file!r}; {_available(ordered)}"
            )
        primary = found[0]
    else:
        candidates = _first_parts(ordered)
        for quant in (reference.quant,) if reference.quant else DEFAULT_QUANTS:
            primary = next((f for f in candidates if _matches(f.path, quant)), None)
            if primary is not None:
                break
        if primary is None and reference.quant is None and candidates:
            primary = candidates[0]
        if primary is None:
            what = f"no {reference.quant} GGUF" if reference.quant else "no model GGUF"
            raise PullError("hub_not_found", f"{where} has {what}; {_available(ordered)}")
    parts = _split_set(ordered, primary, where)
    mmproj = _projector(ordered, parts[0].path) if is_model_file(primary.path) else None
    return Plan(reference=reference, commit=commit, parts=parts, mmproj=mmproj)


def _split_set(
    files: Sequence[RemoteFile], primary: RemoteFile, where: str
) -> tuple[RemoteFile, ...]:
    info = split_info(primary.path)
    if info.count <= 1:
        return (primary,)
    members: dict[int, RemoteFile] = {}
    for f in files:
        other = split_info(f.path)
        if other.count == info.count and other.prefix == info.prefix:
            members[other.index] = f
    missing = [i for i in range(1, info.count + 1) if i not in members]
    if missing:
        raise PullError(
            "hub_not_found",
            f"{where}: the split GGUF {info.prefix}.gguf lacks part(s) "
            f"{', '.join(str(i) for i in missing)} of {info.count}",
        )
    return tuple(members[i] for i in range(1, info.count + 1))


def _projector(files: Sequence[RemoteFile], model_path: str) -> RemoteFile | None:
    """The multimodal projector for ``model_path``: a ``*mmproj*.gguf`` in its
    folder or a folder above it, the deepest first, then the one whose
    quantization is closest to the model's (llama.cpp's choice)."""
    model_dirs = model_path.split("/")[:-1]
    model_bits = _quant_bits(model_path)
    best: tuple[int, int, str] | None = None
    chosen: RemoteFile | None = None
    for f in files:
        name = _file_name(f.path).lower()
        if not name.endswith(".gguf") or "mmproj" not in name:
            continue
        dirs = f.path.split("/")[:-1]
        if dirs != model_dirs[: len(dirs)]:
            continue
        rank = (-len(dirs), abs(_quant_bits(f.path) - model_bits), f.path)
        if best is None or rank < best:
            best, chosen = rank, f
    return chosen
