"""What the Hub's cache holds: its GGUFs, their size, who uses them; removing one.

The cache is huggingface_hub's (``scan_cache_dir`` reads it), shared with
every tool that uses that library: ``wsserver models`` shows its GGUF files
only — a split set as one model, a projector as such — and the downloads
left part-way (``blobs/<sha256>.incomplete``: a later pull resumes them).

**Who uses a file** is read from a configuration: each llama model whose
``model`` is an ``hf:`` reference (resolved against the cache, as an offline
pull would) or a path that leads to a cached file, and the files of
``backend.llama.models_dir``.

**Removing** a model (:func:`remove`) takes a reference, resolved against the
cache like an offline pull: its parts' pointers go from the snapshot, then
every blob no pointer leads to any more, then what is left empty (a snapshot,
the repository's folder with its refs). A projector goes with the last model
of its folder. Another revision's or another quantization's files stay.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import PullError
from .hub import Hub
from .reference import Reference, is_model_file, parse_reference, split_info

__all__ = ["CachedModel", "Partial", "cached_models", "partials", "remove", "used_by"]


@dataclass(frozen=True, slots=True)
class CachedModel:
    """A GGUF in the cache: a model (all parts of a split set) or a projector."""

    repo: str
    #: Its path in the repository (the first part's, for a split set).
    path: str
    commit: str
    #: The branches and tags that point at its revision (``main``, …).
    refs: tuple[str, ...]
    #: Its files in the snapshot, in order.
    files: tuple[Path, ...]
    size: int
    projector: bool = False
    #: Who uses it (filled by :func:`used_by`): ``name (where)`` for each model.
    used_by: tuple[str, ...] = field(default=())

    @property
    def reference(self) -> str:
        """The reference that pulls exactly this file."""
        return f"{self.repo}/{self.path}"

    @property
    def quant(self) -> str:
        return split_info(self.path).tag


@dataclass(frozen=True, slots=True)
class Partial:
    """A download left part-way: the next pull of it resumes here."""

    repo: str
    path: Path
    size: int


def _scan(cache_dir: Path) -> Any:
    from huggingface_hub import CacheNotFound, scan_cache_dir

    try:
        return scan_cache_dir(cache_dir)
    except CacheNotFound:
        return None


def cached_models(cache_dir: Path) -> list[CachedModel]:
    """Every GGUF of every model repository in the cache, by repository and path."""
    info = _scan(cache_dir)
    if info is None:
        return []
    found: list[CachedModel] = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model":
            continue
        for revision in sorted(repo.revisions, key=lambda r: r.commit_hash):
            paths = {
                f.file_path.relative_to(revision.snapshot_path).as_posix(): f
                for f in revision.files
                if f.file_name.lower().endswith(".gguf")
            }
            found.extend(_group(repo.repo_id, revision, paths))
    return found


def _group(repo: str, revision: Any, files: Mapping[str, Any]) -> Iterable[CachedModel]:
    sets: dict[tuple[str, int], list[str]] = {}
    for path in sorted(files):
        info = split_info(path)
        sets.setdefault((info.prefix, info.count), []).append(path)
    refs = tuple(sorted(revision.refs))
    for (_, count), paths in sorted(sets.items(), key=lambda item: item[1][0]):
        # An incomplete set (a pull stopped between parts) is listed part by part.
        groups = [[p] for p in paths] if count > 1 and len(paths) != count else [paths]
        for group in groups:
            yield CachedModel(
                repo=repo,
                path=group[0],
                commit=revision.commit_hash,
                refs=refs,
                files=tuple(files[p].file_path for p in group),
                size=sum(files[p].size_on_disk for p in group),
                projector=not is_model_file(group[0]),
            )


def partials(cache_dir: Path) -> list[Partial]:
    """Downloads left part-way, by repository."""
    found: list[Partial] = []
    if not cache_dir.is_dir():
        return found
    for folder in sorted(cache_dir.glob("models--*")):
        repo = folder.name[len("models--") :].replace("--", "/", 1)
        for partial in sorted((folder / "blobs").glob("*.incomplete")):
            found.append(Partial(repo, partial, partial.stat().st_size))
    return found


def used_by(models: list[CachedModel], config: Any, hub: Hub) -> list[CachedModel]:
    """``models`` with who uses each, per ``config`` (a :class:`wsserver.config.Config`)."""
    users: dict[Path, list[str]] = {}

    def note(path: Path, who: str) -> None:
        with contextlib.suppress(OSError):
            users.setdefault(path.resolve(), []).append(who)

    llama = config.backend.llama
    settings: list[tuple[str, str, str]] = []
    if llama.model:
        settings.append(("the default model", llama.model, "backend.llama.model"))
    for index, table in enumerate(llama.models):
        settings.append((table.name, table.model, f"backend.llama.models[{index}]"))
    for name, setting, where in settings:
        who = f"{name} ({where})"
        if setting.startswith("hf:"):
            try:
                plan = hub.resolve_cached(parse_reference(setting))
            except PullError:
                continue
            storage = hub.settings.cache() / ("models--" + plan.reference.repo.replace("/", "--"))
            for remote in plan.files:
                note(storage / "snapshots" / (plan.commit or "") / remote.path, who)
        else:
            note(Path(setting).expanduser(), who)
    if llama.models_dir and Path(llama.models_dir).is_dir():
        for path in Path(llama.models_dir).glob("*.gguf"):
            note(path, f"{path.stem} (backend.llama.models_dir)")
    out: list[CachedModel] = []
    for model in models:
        names: list[str] = []
        for file in model.files:
            names.extend(users.get(file.resolve(), []))
        out.append(dataclasses.replace(model, used_by=tuple(dict.fromkeys(names))))
    return out


def remove(reference: Reference | str, hub: Hub) -> list[Path]:
    """Remove a cached model (resolved from the cache alone); the files removed.

    Raises :class:`~wsserver.errors.PullError` (``hub_not_found``) when the
    cache does not hold it.
    """
    ref = parse_reference(reference) if isinstance(reference, str) else reference
    try:
        plan = hub.resolve_cached(ref)
    except PullError:
        raise PullError("hub_not_found", f"{ref.text} is not in the cache") from None
    cache = hub.settings.cache()
    storage = cache / ("models--" + ref.repo.replace("/", "--"))
    snapshot = storage / "snapshots" / (plan.commit or "")
    pointers = [snapshot / f.path for f in plan.parts]
    if plan.mmproj is not None:
        others = [
            p
            for p in snapshot.rglob("*.gguf")
            if is_model_file(p.name) and p not in pointers and p.parent == pointers[0].parent
        ]
        if not others:
            pointers.append(snapshot / plan.mmproj.path)
    removed: list[Path] = []
    targets = set()
    for pointer in pointers:
        if pointer.is_symlink() or pointer.exists():
            targets.add(pointer.resolve())
            pointer.unlink()
            removed.append(pointer)
    still_used = {p.resolve() for p in storage.glob("snapshots/*/**/*") if p.is_file()}
    for blob in sorted(targets - still_used):
        if blob.is_file() and blob.parent == storage / "blobs":
            blob.unlink()
            removed.append(blob)
    _prune(snapshot, stop=storage / "snapshots")
    snapshots = storage / "snapshots"
    if not snapshots.is_dir() or not any(snapshots.iterdir()):
        shutil.rmtree(storage, ignore_errors=True)
        shutil.rmtree(cache / ".locks" / storage.name, ignore_errors=True)
    return removed


def _prune(folder: Path, *, stop: Path) -> None:
    """Remove ``folder`` and its empty subfolders, and empty parents up to ``stop``."""
    if folder.is_dir():
        for path in sorted(folder.rglob("*"), key=lambda p: len(p.parts), reverse=True):
            if path.is_dir() and not any(path.iterdir()):
                path.rmdir()
    while folder != stop and folder.is_dir() and not any(folder.iterdir()):
        folder.rmdir()
        folder = folder.parent


def remove_partials(repo: str, hub: Hub) -> list[Path]:
    """Remove a repository's partial downloads (a pull of it starts over)."""
    storage = hub.settings.cache() / ("models--" + repo.replace("/", "--"))
    removed = []
    for partial in sorted((storage / "blobs").glob("*.incomplete")):
        os.unlink(partial)
        removed.append(partial)
    return removed
