"""References and the choice of files (wsserver/pull/reference.py): sans-I/O."""

from __future__ import annotations

import pytest

from wsserver.errors import PullError
from wsserver.pull.reference import (
    Reference,
    RemoteFile,
    parse_reference,
    plan_files,
    split_info,
)


def files(*paths: str) -> list[RemoteFile]:
    return [RemoteFile(path, 100 + i, sha256=f"{i:064x}") for i, path in enumerate(paths)]


# ---------------------------------------------------------------- parsing


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("org/repo", Reference("org/repo")),
        ("hf:org/repo", Reference("org/repo")),
        ("ggml-org/gemma-3-1b-it-GGUF:Q4_K_M", Reference("ggml-org/gemma-3-1b-it-GGUF", "Q4_K_M")),
        ("unsloth/Qwen3-GGUF:UD-Q4_K_XL", Reference("unsloth/Qwen3-GGUF", "UD-Q4_K_XL")),
        ("org/repo/model.Q8_0.gguf", Reference("org/repo", file="model.Q8_0.gguf")),
        ("org/repo/sub dir/a+b (1).gguf", Reference("org/repo", file="sub dir/a+b (1).gguf")),
        ("org/repo@v1.0", Reference("org/repo", revision="v1.0")),
        ("org/repo:q8_0@refs/pr/3", Reference("org/repo", "q8_0", revision="refs/pr/3")),
        ("hf:org/repo/x.gguf@" + "a" * 40, Reference("org/repo", file="x.gguf", revision="a" * 40)),
        ("Org.Name/re_po-1", Reference("Org.Name/re_po-1")),
    ],
)
def test_references_parse(text: str, expected: Reference) -> None:
    ref = parse_reference(text)
    assert ref == expected
    assert parse_reference(ref.text) == ref  # the canonical text parses back


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("", "give org/repo"),
        ("repo", "give org/repo"),
        ("hf:", "give org/repo"),
        ("org/", "repository name"),
        ("/org/repo", "not a URL or a path"),
        ("~/models/x.gguf", "not a URL or a path"),
        ("./x.gguf", "not a URL or a path"),
        ("https://huggingface.co/org/repo", "not a URL"),
        ("org/repo/../../etc/passwd.gguf", "segment '..'"),
        ("org/repo/./x.gguf", "segment '.'"),
        ("org/repo//x.gguf", "segment ''"),
        ("org/repo/x.gguf/", "segment ''"),
        ("org/repo/a\\b.gguf", "segment"),
        ("org/repo/x%2F..%2Fy.gguf", "segment"),
        ("org/repo/x.gguf?download=1", "segment"),
        ("org/repo/x.gguf#frag", "segment"),
        ("org/repo/model.safetensors", "only .gguf"),
        ("org/repo/config.json", "only .gguf"),
        ("org/repo:Q4 K", "quantization"),
        ("org/repo:Q4/../x", "repository name"),
        ("org/repo:", "quantization"),
        ("org/repo/x.gguf:Q4_K_M", "segment"),
        ("org--x/repo", "organisation name"),
        ("org/re..po", "repository name"),
        ("-org/repo", "organisation name"),
        ("org/repo-", "repository name"),
        ("org/" + "r" * 97, "repository name"),
        ("org/repo.git", ".git"),
        ("org/repo@../main", "revision"),
        ("org/repo@", "revision"),
        ("org/repo@main/", "does not end with '/'"),
        ("org/repo@a//b", "revision"),
        ("org/repo@x y", "revision"),
        ("org/re\npo", "control character"),
        ("org/repo\x00", "control character"),
        ("org/repo\u0085", "control character"),
        ("x" * 2000, "longer than 1024"),
        ("org@evil.example/repo", "give org/repo"),
    ],
)
def test_untrusted_references_are_refused_with_the_reason(text: str, why: str) -> None:
    with pytest.raises(PullError) as info:
        parse_reference(text)
    assert info.value.code == "bad_reference"
    assert why in info.value.message


def test_a_reference_names_a_model_without_its_revision() -> None:
    assert parse_reference("hf:org/repo:Q4_K_M@v2").name == "org/repo:Q4_K_M"
    assert parse_reference("org/repo/x.gguf").name == "org/repo/x.gguf"


# ---------------------------------------------------------------- choosing files


def test_without_a_quantization_q4_k_m_is_chosen_then_q8_0_then_the_first() -> None:
    listing = files("README.md", "m-Q2_K.gguf", "m-Q8_0.gguf", "m-Q4_K_M.gguf", "m-F16.gguf")
    assert plan_files(Reference("o/r"), listing, "c").parts[0].path == "m-Q4_K_M.gguf"
    listing = files("m-Q2_K.gguf", "m-Q8_0.gguf", "m-F16.gguf")
    assert plan_files(Reference("o/r"), listing, "c").parts[0].path == "m-Q8_0.gguf"
    listing = files("m-F16.gguf", "m-Q2_K.gguf", "mmproj-F16.gguf")
    plan = plan_files(Reference("o/r"), listing, "c")
    assert plan.parts[0].path == "m-F16.gguf"  # the first by path


def test_a_quantization_is_matched_case_insensitively_at_a_separator() -> None:
    listing = files("m-IQ4_XS.gguf", "m.Q4_0.gguf", "m-IQ4_0.gguf", "m-q8_0.gguf")
    assert plan_files(Reference("o/r", "Q8_0"), listing, "c").parts[0].path == "m-q8_0.gguf"
    # Q4_0 is not IQ4_0 (llama.cpp's plain substring search would take either).
    assert plan_files(Reference("o/r", "q4_0"), listing, "c").parts[0].path == "m.Q4_0.gguf"
    with pytest.raises(PullError) as info:
        plan_files(Reference("o/r", "Q5_K_M"), listing, "c")
    assert info.value.code == "hub_not_found"
    assert "no Q5_K_M GGUF" in info.value.message and "m-IQ4_XS.gguf" in info.value.message


def test_projectors_and_imatrix_files_are_never_the_model() -> None:
    listing = files("mmproj-m-Q4_K_M.gguf", "imatrix-Q4_K_M.gguf", "m-Q4_K_M.gguf")
    plan = plan_files(Reference("o/r"), listing, "c")
    assert plan.parts[0].path == "m-Q4_K_M.gguf"
    assert plan.mmproj is not None and plan.mmproj.path == "mmproj-m-Q4_K_M.gguf"
    with pytest.raises(PullError) as info:
        plan_files(Reference("o/r"), files("mmproj-F16.gguf", "README.md"), "c")
    assert info.value.code == "hub_not_found"


def test_the_projector_closest_in_folder_and_bits_goes_with_the_model() -> None:
    listing = files(
        "mmproj-F16.gguf",
        "q4/m-Q4_K_M.gguf",
        "q4/mmproj-F32.gguf",
        "q4/mmproj-Q8_0.gguf",
        "other/mmproj-Q4_K_M.gguf",
    )
    plan = plan_files(Reference("o/r", file="q4/m-Q4_K_M.gguf"), listing, "c")
    assert plan.mmproj is not None and plan.mmproj.path == "q4/mmproj-Q8_0.gguf"
    plan = plan_files(
        Reference("o/r", file="q4/m-Q4_K_M.gguf"), files("mmproj-F16.gguf", "q4/m-Q4_K_M.gguf"), "c"
    )
    assert plan.mmproj is not None and plan.mmproj.path == "mmproj-F16.gguf"  # a folder above
    assert plan_files(Reference("o/r"), files("m-Q4_K_M.gguf"), "c").mmproj is None


def test_a_split_gguf_is_fetched_whole_and_loaded_from_its_first_part() -> None:
    listing = files(
        "big-Q4_K_M-00002-of-00003.gguf",
        "big-Q4_K_M-00001-of-00003.gguf",
        "big-Q4_K_M-00003-of-00003.gguf",
        "big-Q8_0-00001-of-00002.gguf",
        "big-Q8_0-00002-of-00002.gguf",
    )
    plan = plan_files(Reference("o/r"), listing, "c")
    assert [f.path for f in plan.parts] == [
        "big-Q4_K_M-00001-of-00003.gguf",
        "big-Q4_K_M-00002-of-00003.gguf",
        "big-Q4_K_M-00003-of-00003.gguf",
    ]
    assert plan.total_bytes == sum(f.size for f in plan.parts)
    assert plan.quant == "Q4_K_M"
    # Naming any part fetches the whole set, first part first.
    named = plan_files(Reference("o/r", file="big-Q8_0-00002-of-00002.gguf"), listing, "c")
    assert [f.path for f in named.parts] == [
        "big-Q8_0-00001-of-00002.gguf",
        "big-Q8_0-00002-of-00002.gguf",
    ]
    with pytest.raises(PullError) as info:
        plan_files(Reference("o/r"), listing[1:3], "c")
    assert info.value.code == "hub_not_found" and "lacks part(s) 2 of 3" in info.value.message


def test_a_named_file_must_be_there() -> None:
    listing = files("a/b-Q4_K_M.gguf")
    assert plan_files(Reference("o/r", file="A/B-q4_k_m.gguf"), listing, "c").parts[0].path == (
        "a/b-Q4_K_M.gguf"
    )
    with pytest.raises(PullError) as info:
        plan_files(Reference("o/r", file="nope.gguf", revision="v1"), listing, "c")
    assert info.value.code == "hub_not_found"
    assert "o/r@v1 has no file 'nope.gguf'" in info.value.message


def test_split_info_reads_llama_cpp_names() -> None:
    assert split_info("x/Model-Q4_K_M-00002-of-00005.gguf").index == 2
    assert split_info("x/Model-Q4_K_M-00002-of-00005.gguf").count == 5
    assert split_info("model.q8_0.gguf").tag == "Q8_0"
    assert split_info("model.gguf").tag == ""


def test_listed_paths_that_leave_the_folder_are_ignored() -> None:
    listing = files(
        "../x-Q4_K_M.gguf",
        "/abs-Q4_K_M.gguf",
        "a//b-Q4_K_M.gguf",
        "a\\b-Q4_K_M.gguf",
        "m-Q8_0.gguf",
    )
    assert plan_files(Reference("o/r"), listing, "c").parts[0].path == "m-Q8_0.gguf"
