"""The download core (wsserver/pull/hub.py) against a local imitation of the Hub.

Nothing reaches the internet: every test talks to tests/fake_hub.py on
127.0.0.1 and writes into a cache under its own temporary directory. The
files are random bytes named like GGUFs (the download does not read them) of
a few megabytes — several of ``DOWNLOAD_CHUNK`` — so that a download can be
caught in the middle.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import timeout
from fake_hub import FakeHub, git_oid, sha256

from wsserver.errors import PullError
from wsserver.pull.hub import DOWNLOAD_CHUNK, Hub, HubSettings, PullCancelled
from wsserver.pull.progress import Progress

MiB = 1 << 20
REPO = "org/tiny-GGUF"


@pytest.fixture
def files() -> dict[str, bytes]:
    return {
        "README.md": b"# tiny\n",
        "tiny-Q4_K_M.gguf": os.urandom(5 * MiB + 123),
        "tiny-Q8_0.gguf": os.urandom(2 * MiB),
        "mmproj-tiny-F16.gguf": os.urandom(MiB // 2),
    }


@pytest.fixture
def hub(files: dict[str, bytes]) -> Iterator[FakeHub]:
    with FakeHub() as fake:
        fake.add_repo(REPO, files, in_git=("README.md",))
        yield fake


def settings(fake: FakeHub, cache: Path, **kwargs: object) -> HubSettings:
    return HubSettings(endpoint=fake.url, cache_dir=cache, **kwargs)  # type: ignore[arg-type]


def storage(cache: Path) -> Path:
    return cache / "models--org--tiny-GGUF"


class Reached:
    """A report callback that sets an event once ``completed`` reaches ``bytes``:
    the client has *written* that much (the server's sending it says nothing
    about that: the socket buffers megabytes)."""

    def __init__(self, bytes: int) -> None:
        self.bytes = bytes
        self.event = threading.Event()

    def __call__(self, progress: Progress) -> None:
        if progress.status == "downloading" and progress.completed >= self.bytes:
            self.event.set()

    def wait(self) -> bool:
        return self.event.wait(timeout())


def leftovers(cache: Path) -> list[str]:
    """Partial downloads anywhere in the cache."""
    return sorted(p.name for p in cache.rglob("*.incomplete"))


def test_the_chunk_knob_is_still_huggingface_hubs() -> None:
    from huggingface_hub import constants

    assert isinstance(constants.DOWNLOAD_CHUNK_SIZE, int)
    assert (
        DOWNLOAD_CHUNK <= constants.DOWNLOAD_CHUNK_SIZE
        or constants.DOWNLOAD_CHUNK_SIZE == DOWNLOAD_CHUNK
    )


def test_a_fresh_pull_lands_in_the_hubs_cache_layout(
    hub: FakeHub, files: dict[str, bytes], tmp_path: Path
) -> None:
    reports: list[Progress] = []
    pulled = Hub(settings(hub, tmp_path)).pull("hf:org/tiny-GGUF", report=reports.append)
    model = files["tiny-Q4_K_M.gguf"]
    projector = files["mmproj-tiny-F16.gguf"]
    commit = hub.repos[REPO].commit
    root = storage(tmp_path)
    assert pulled.model_path == root / "snapshots" / commit / "tiny-Q4_K_M.gguf"
    assert pulled.model_path.is_symlink()
    assert pulled.model_path.resolve() == root / "blobs" / sha256(model)
    assert pulled.model_path.read_bytes() == model
    assert pulled.mmproj is not None and pulled.mmproj.read_bytes() == projector
    assert (root / "refs" / "main").read_text() == commit
    assert pulled.downloaded == len(model) + len(projector)
    assert leftovers(tmp_path) == []
    # One GET per file, each from its first byte; the other quantization is not fetched.
    assert [(g.digest, g.start) for g in hub.gets] == [
        (sha256(model), 0),
        (sha256(projector), 0),
    ]
    # Progress covers the whole pull, never goes back, and ends done.
    total = len(model) + len(projector)
    assert reports[0].status == "resolving"
    assert reports[-1] == Progress("done", total, total)
    completed = [r.completed for r in reports if r.total]
    assert completed == sorted(completed)
    assert {r.file for r in reports if r.status == "downloading"} == {
        "tiny-Q4_K_M.gguf",
        "mmproj-tiny-F16.gguf",
    }


def test_huggingface_hub_reads_what_a_pull_wrote(
    hub: FakeHub, files: dict[str, bytes], tmp_path: Path
) -> None:
    from huggingface_hub import try_to_load_from_cache

    Hub(settings(hub, tmp_path)).pull("org/tiny-GGUF")
    found = try_to_load_from_cache(REPO, "tiny-Q4_K_M.gguf", cache_dir=tmp_path)
    assert isinstance(found, str) and Path(found).read_bytes() == files["tiny-Q4_K_M.gguf"]


def test_a_file_another_tool_cached_is_verified_and_reused(
    hub: FakeHub, files: dict[str, bytes], tmp_path: Path
) -> None:
    from huggingface_hub import hf_hub_download

    hf_hub_download(REPO, "tiny-Q8_0.gguf", cache_dir=tmp_path, endpoint=hub.url)
    before = len(hub.gets)
    reports: list[Progress] = []
    pulled = Hub(settings(hub, tmp_path)).pull("org/tiny-GGUF:Q8_0", report=reports.append)
    assert len(hub.gets) == before + 1  # only the projector
    assert pulled.model_path.read_bytes() == files["tiny-Q8_0.gguf"]
    assert "checking" in {r.status for r in reports}


def test_a_repository_with_several_quantizations(
    hub: FakeHub, files: dict[str, bytes], tmp_path: Path
) -> None:
    client = Hub(settings(hub, tmp_path))
    assert client.pull("org/tiny-GGUF:q8_0").model_path.read_bytes() == files["tiny-Q8_0.gguf"]
    with pytest.raises(PullError) as info:
        client.pull("org/tiny-GGUF:Q5_K_M")
    assert info.value.code == "hub_not_found"
    assert "tiny-Q4_K_M.gguf" in info.value.message  # it lists what there is


def test_a_named_file_in_git_is_checked_by_its_git_blob_id(tmp_path: Path) -> None:
    data = os.urandom(300_000)
    with FakeHub() as fake:
        fake.add_repo("org/small", {"sub/tiny.gguf": data}, in_git=("sub/tiny.gguf",))
        pulled = Hub(settings(fake, tmp_path)).pull("org/small/sub/tiny.gguf")
        assert pulled.model_path.read_bytes() == data
        assert pulled.model_path.resolve().name == git_oid(data)
        fake.corrupt(git_oid(data))
        with pytest.raises(PullError) as info:
            Hub(settings(fake, tmp_path / "again")).pull("org/small/sub/tiny.gguf")
        assert info.value.code == "verification_failed"


def test_a_split_gguf_is_fetched_whole_beside_itself(tmp_path: Path) -> None:
    parts = {f"big-Q4_K_M-0000{i}-of-00003.gguf": os.urandom(MiB + i) for i in (1, 2, 3)}
    with FakeHub() as fake:
        commit = fake.add_repo("org/big", {**parts, "big-Q8_0.gguf": b"x" * 10})
        pulled = Hub(settings(fake, tmp_path)).pull("org/big")
    assert [p.name for p in pulled.parts] == sorted(parts)
    assert pulled.model_path.name == "big-Q4_K_M-00001-of-00003.gguf"
    # llama.cpp finds the other parts by name in the first one's folder.
    folder = tmp_path / "models--org--big" / "snapshots" / commit
    assert {p.parent for p in pulled.parts} == {folder}
    for path in pulled.parts:
        assert path.read_bytes() == parts[path.name]


def test_a_revision_pins_the_files(hub: FakeHub, files: dict[str, bytes], tmp_path: Path) -> None:
    commit = hub.repos[REPO].commit
    pulled = Hub(settings(hub, tmp_path)).pull(f"org/tiny-GGUF:Q8_0@{commit}")
    assert pulled.plan.commit == commit
    with pytest.raises(PullError) as info:
        Hub(settings(hub, tmp_path)).pull("org/tiny-GGUF@no-such-branch")
    assert info.value.code == "hub_not_found" and "revision" in info.value.message


def test_hub_errors_have_their_codes(hub: FakeHub, tmp_path: Path) -> None:
    client = Hub(settings(hub, tmp_path))
    with pytest.raises(PullError) as info:
        client.pull("org/no-such-repo")
    assert info.value.code == "hub_not_found" and "HF_TOKEN" in info.value.message
    hub.add_repo("org/gated", {"m-Q4_K_M.gguf": b"x" * 100}, gated=True)
    with pytest.raises(PullError) as info:
        client.pull("org/gated")
    assert info.value.code == "hub_unauthorized" and "gated" in info.value.message
    with pytest.raises(PullError) as info:
        client.pull("org/tiny-GGUF/not-there.gguf")
    assert info.value.code == "hub_not_found"
    port = hub.port
    nowhere = HubSettings(
        endpoint=f"http://127.0.0.1:{port + 1 if port < 65535 else 1}", cache_dir=tmp_path / "x"
    )
    with pytest.raises(PullError) as info:
        Hub(nowhere).pull("org/tiny-GGUF")
    assert info.value.code == "hub_unreachable"


def test_a_pull_interrupted_mid_file_resumes_where_it_stopped(
    hub: FakeHub, files: dict[str, bytes], tmp_path: Path
) -> None:
    model = files["tiny-Q4_K_M.gguf"]
    digest = sha256(model)
    cancel = threading.Event()
    errors: list[BaseException] = []
    client = Hub(settings(hub, tmp_path))

    written = Reached(2 * MiB)

    def first() -> None:
        try:
            client.pull("org/tiny-GGUF", cancel=cancel, report=written)
        except BaseException as exc:
            errors.append(exc)

    with hub.held(digest, after=2 * MiB + MiB // 2):
        worker = threading.Thread(target=first)
        worker.start()
        assert written.wait()
        cancel.set()
    worker.join(timeout())
    assert len(errors) == 1 and isinstance(errors[0], PullCancelled)
    partial = storage(tmp_path) / "blobs" / f"{digest}.incomplete"
    kept = partial.stat().st_size
    assert kept == 2 * MiB  # the chunks written before the cancel; no more
    assert not (storage(tmp_path) / "blobs" / digest).exists()
    assert not (storage(tmp_path) / "snapshots").exists()

    pulled = Hub(settings(hub, tmp_path)).pull("org/tiny-GGUF")
    assert pulled.model_path.read_bytes() == model
    second = hub.gets_of(digest)[-1]
    assert second.start == kept  # a Range request from where the first stopped
    assert second.sent == len(model) - kept  # the kept bytes did not come again
    assert pulled.downloaded == len(model) - kept + len(files["mmproj-tiny-F16.gguf"])
    assert leftovers(tmp_path) == []


def test_a_dropped_connection_is_resumed_within_the_pull(
    hub: FakeHub, files: dict[str, bytes], tmp_path: Path
) -> None:
    model = files["tiny-Q4_K_M.gguf"]
    digest = sha256(model)
    hub.cut(digest, after=3 * MiB)
    pulled = Hub(settings(hub, tmp_path)).pull("org/tiny-GGUF")
    assert pulled.model_path.read_bytes() == model
    gets = hub.gets_of(digest)
    # huggingface_hub retried with a Range from the bytes it had written.
    assert len(gets) == 2 and gets[1].start == 3 * MiB
    assert hub.total_sent(digest) == len(model)


def test_a_corrupted_byte_is_refused_and_leaves_nothing(
    hub: FakeHub, files: dict[str, bytes], tmp_path: Path
) -> None:
    digest = sha256(files["tiny-Q4_K_M.gguf"])
    hub.corrupt(digest)
    with pytest.raises(PullError) as info:
        Hub(settings(hub, tmp_path)).pull("org/tiny-GGUF")
    assert info.value.code == "verification_failed"
    assert digest in info.value.message
    blobs = storage(tmp_path) / "blobs"
    assert not (blobs / digest).exists()
    assert leftovers(tmp_path) == []
    assert not (storage(tmp_path) / "snapshots").exists()


def test_a_cached_file_damaged_on_disk_is_refused(
    hub: FakeHub, files: dict[str, bytes], tmp_path: Path
) -> None:
    pulled = Hub(settings(hub, tmp_path)).pull("org/tiny-GGUF:Q8_0")
    blob = pulled.model_path.resolve()
    data = bytearray(blob.read_bytes())
    data[1000] ^= 1
    blob.chmod(0o644)
    blob.write_bytes(bytes(data))
    with pytest.raises(PullError) as info:
        Hub(settings(hub, tmp_path)).pull("org/tiny-GGUF:Q8_0")  # a new process, say
    assert (
        info.value.code == "verification_failed"
        and "wsserver models --remove" in info.value.message
    )


def test_two_pulls_of_one_file_download_it_once(
    hub: FakeHub, files: dict[str, bytes], tmp_path: Path
) -> None:
    digest = sha256(files["tiny-Q4_K_M.gguf"])
    client = Hub(settings(hub, tmp_path))
    results: list[object] = []

    def pull() -> None:
        try:
            results.append(client.pull("org/tiny-GGUF"))
        except BaseException as exc:
            results.append(exc)

    with hub.held(digest, after=MiB) as fault:
        first = threading.Thread(target=pull)
        first.start()
        assert fault.reached.wait(timeout())
        heads = hub.heads
        second = threading.Thread(target=pull)
        second.start()
        # Once the second has asked the Hub about the file, it waits for the first.
        assert hub.wait_for_heads(heads + 1, timeout())
    first.join(timeout())
    second.join(timeout())
    assert all(not isinstance(r, BaseException) for r in results), results
    assert len(hub.gets_of(digest)) == 1


def test_cancel_mid_download_leaves_no_usable_half_file(
    hub: FakeHub, files: dict[str, bytes], tmp_path: Path
) -> None:
    digest = sha256(files["tiny-Q4_K_M.gguf"])
    cancel = threading.Event()
    written = Reached(MiB)
    errors: list[BaseException] = []

    def pull() -> None:
        try:
            Hub(settings(hub, tmp_path)).pull("org/tiny-GGUF", cancel=cancel, report=written)
        except BaseException as exc:
            errors.append(exc)

    with hub.held(digest, after=3 * MiB):
        worker = threading.Thread(target=pull)
        worker.start()
        assert written.wait()
        cancel.set()
    worker.join(timeout())
    assert len(errors) == 1 and isinstance(errors[0], PullCancelled)
    # Only the partial file, under a name no loader reads; no blob, no snapshot.
    blobs = storage(tmp_path) / "blobs"
    assert [p.name for p in blobs.iterdir()] == [f"{digest}.incomplete"]
    assert not (storage(tmp_path) / "snapshots").exists()


def test_offline_a_cached_model_is_served_from_the_cache(
    hub: FakeHub, files: dict[str, bytes], tmp_path: Path
) -> None:
    online = Hub(settings(hub, tmp_path)).pull("org/tiny-GGUF")
    calls = (hub.api_calls, hub.heads, len(hub.gets))
    offline = Hub(settings(hub, tmp_path, offline=True)).pull("org/tiny-GGUF")
    assert (hub.api_calls, hub.heads, len(hub.gets)) == calls  # the Hub was not asked
    assert offline.parts == online.parts and offline.mmproj == online.mmproj
    with pytest.raises(PullError) as info:
        Hub(settings(hub, tmp_path, offline=True)).pull("org/tiny-GGUF:Q8_0")
    assert info.value.code == "hub_unreachable" and "offline" in info.value.message
    with pytest.raises(PullError) as info:
        Hub(settings(hub, tmp_path, offline=True)).pull("org/other")
    assert info.value.code == "hub_unreachable"


def test_an_unreachable_hub_falls_back_to_the_cache(
    files: dict[str, bytes], tmp_path: Path
) -> None:
    with FakeHub() as fake:
        fake.add_repo(REPO, files)
        Hub(settings(fake, tmp_path)).pull("org/tiny-GGUF")
        endpoint = fake.url
    pulled = Hub(HubSettings(endpoint=endpoint, cache_dir=tmp_path)).pull("org/tiny-GGUF")
    assert pulled.model_path.read_bytes() == files["tiny-Q4_K_M.gguf"]


def test_the_size_cap_is_checked_before_the_first_byte(hub: FakeHub, tmp_path: Path) -> None:
    with pytest.raises(PullError) as info:
        Hub(settings(hub, tmp_path, max_download_bytes=4 * MiB)).pull("org/tiny-GGUF")
    assert info.value.code == "download_too_large"
    assert "models.max_download_bytes" in info.value.message
    assert hub.gets == []


def test_not_enough_disk_space_is_said_before_the_first_byte(hub: FakeHub, tmp_path: Path) -> None:
    client = Hub(settings(hub, tmp_path), disk_free=lambda path: 3 * MiB)
    with pytest.raises(PullError) as info:
        client.pull("org/tiny-GGUF")
    assert info.value.code == "disk_full"
    assert "needs 5,767,291 bytes more, 3,145,728 are free" in info.value.message
    assert hub.gets == []


# ---------------------------------------------------------------- a real small disk


@contextlib.contextmanager
def tmpfs(path: Path, size: int) -> Iterator[Path]:
    """A tmpfs of ``size`` bytes mounted at ``path`` (root only: else skipped;
    the seam test above covers the check everywhere)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    path.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        capture_output=True,
        check=False,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {mounted.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_a_disk_too_small_is_refused_before_anything_is_written(
    hub: FakeHub, tmp_path: Path
) -> None:
    with tmpfs(tmp_path / "disk", 2 * MiB) as disk:
        with pytest.raises(PullError) as info:
            Hub(settings(hub, disk / "cache")).pull("org/tiny-GGUF")
        assert info.value.code == "disk_full"
        assert str(disk) in info.value.message
        assert list(disk.iterdir()) == []
    assert hub.gets == []


def test_a_disk_that_fills_up_mid_download_leaves_nothing_half_written(
    hub: FakeHub, files: dict[str, bytes], tmp_path: Path
) -> None:
    digest = sha256(files["tiny-Q4_K_M.gguf"])
    with tmpfs(tmp_path / "disk", 8 * MiB) as disk:
        errors: list[BaseException] = []

        written = Reached(2 * MiB)

        def pull() -> None:
            try:
                Hub(settings(hub, disk / "cache")).pull("org/tiny-GGUF", report=written)
            except BaseException as exc:
                errors.append(exc)

        with hub.held(digest, after=2 * MiB + MiB // 2):
            worker = threading.Thread(target=pull)
            worker.start()
            assert written.wait()
            # Something else takes the space the check found free.
            free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
            (disk / "filler").write_bytes(b"\0" * (free - MiB // 2))
        worker.join(timeout())
        assert len(errors) == 1 and isinstance(errors[0], PullError), errors
        assert errors[0].code == "disk_full"
        assert leftovers(disk) == []
        assert not (storage(disk / "cache") / "blobs" / digest).exists()


def test_a_listing_that_points_outside_the_cache_is_not_followed(tmp_path: Path) -> None:
    # The endpoint may be a mirror: its listing is input too.
    good = os.urandom(1000)
    with FakeHub() as fake:
        fake.add_repo(
            "org/evil",
            {
                "../../../outside-Q4_K_M.gguf": os.urandom(100),
                "sub/../x-Q4_K_M.gguf": b"x",
                "ok-Q8_0.gguf": good,
            },
        )
        pulled = Hub(settings(fake, tmp_path / "cache")).pull("org/evil")
        assert pulled.model_path.name == "ok-Q8_0.gguf" and pulled.model_path.read_bytes() == good
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache"]
    assert not any("outside" in p.name for p in tmp_path.rglob("*"))


def test_a_commit_that_is_not_one_is_refused(files: dict[str, bytes], tmp_path: Path) -> None:
    with FakeHub() as fake:
        fake.add_repo(REPO, files, commit="../../../tmp")
        with pytest.raises(PullError) as info:
            Hub(settings(fake, tmp_path)).pull("org/tiny-GGUF")
    assert info.value.code == "hub_error" and "no usable commit" in info.value.message
