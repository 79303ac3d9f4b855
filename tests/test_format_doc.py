"""docs/FORMAT.md agrees with what mpack writes: its JSON Schema, its example, and its reader."""

from __future__ import annotations

import copy
import hashlib
import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO

from mpack.convert.pipeline import run_convert
from mpack.convert.source import ResolvedSource, provenance
from mpack.errors import FormatVersionError
from mpack.sidecar import (
    ALIGN,
    COMMON_NAME,
    MANIFEST_NAME,
    digest_of,
    load_manifest,
    rank_file_name,
    read_layout,
)

jsonschema = pytest.importorskip("jsonschema")  # a dev dependency; the GPU machine lacks it

DOC = REPO / "docs" / "FORMAT.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```\s*$", re.S | re.M)


def _blocks(lang: str) -> list[str]:
    return [m.group(2) for m in FENCE.finditer(DOC.read_text()) if m.group(1) == lang]


@pytest.fixture(scope="module")
def schema() -> dict[str, Any]:
    found = [b for b in _blocks("json") if '"$schema"' in b]
    assert len(found) == 1, "FORMAT.md must hold exactly one JSON Schema block"
    return json.loads(found[0])


@pytest.fixture(scope="module")
def validator(schema: dict[str, Any]) -> jsonschema.Draft202012Validator:
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


@pytest.fixture(scope="module")
def read_sidecar():
    found = [b for b in _blocks("python") if "def read_sidecar" in b]
    assert len(found) == 1, "FORMAT.md must hold exactly one reader block"
    ns: dict[str, Any] = {}
    exec(compile(found[0], str(DOC), "exec"), ns)
    return ns["read_sidecar"]


@pytest.fixture(scope="module")
def sidecars(golden: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every golden case converted with its options, plus one with --fuse none --no-passthrough."""
    root = tmp_path_factory.mktemp("sidecars")
    out = {}
    cases = sorted(p for p in (golden / "cases").iterdir() if (p / "case.json").is_file())
    assert cases
    for case in cases:
        opts = json.loads((case / "case.json").read_text())
        if opts.get("expect", "convert") != "convert":
            continue
        run_convert(case / opts.get("input", "input"), root / case.name, profile=opts["profile"],
                    act_dtype=opts["act_dtype"], tp=opts["tp"], fuse=opts.get("fusion", "vllm"),
                    device="cpu")  # fmt: skip
        out[case.name] = root / case.name
    first = cases[0] / "input"
    run_convert(first, root / "fuse-none", profile="w8a16", act_dtype="bfloat16", tp=1,
                fuse="none", device="cpu", passthrough=False)  # fmt: skip
    out["fuse-none"] = root / "fuse-none"
    return out


def _manifest(sidecar: Path) -> dict[str, Any]:
    return json.loads((sidecar / MANIFEST_NAME).read_bytes())


# --- (a) the JSON Schema -------------------------------------------------------------------


def test_real_manifests_match_the_schema(sidecars: dict[str, Path], validator) -> None:
    for name, sidecar in sidecars.items():
        errors = [e.message for e in validator.iter_errors(_manifest(sidecar))]
        assert not errors, f"{name}: {errors}"
    none = _manifest(sidecars["fuse-none"])
    assert {ly["parallel"] for ly in none["layers"].values()} == {"none"}
    assert COMMON_NAME not in {f["name"] for f in none["files"]}


def test_hub_source_matches_the_schema(sidecars: dict[str, Path], validator) -> None:
    m = _manifest(next(iter(sidecars.values())))
    for revision, requested in (("0123456789abcdef" * 2 + "01234567", "main"), (None, None)):
        src = ResolvedSource(path=Path("/cache/snap"), kind="hub", repo="org/name",
                             revision=revision, requested=requested)  # fmt: skip
        hub = {**m, "source": provenance(src, m["source"]["files"])}
        assert not list(validator.iter_errors(hub))


def test_source_files_by_chunks_match_the_schema(sidecars: dict[str, Path], validator) -> None:
    """Note [source digests]: a source file is recorded by sha256 or by chunks, never both or
    neither."""
    m = _manifest(next(iter(sidecars.values())))
    rec = m["source"]["files"][0]
    chunked = {"name": rec["name"], "size": 3 * 2**26 + 5,
               "chunks": {"bytes": 2**26, "sha256": [rec["sha256"]] * 4}}  # fmt: skip
    ok = copy.deepcopy(m)
    ok["source"]["files"][0] = chunked
    assert not list(validator.iter_errors(ok))
    both = copy.deepcopy(ok)
    both["source"]["files"][0]["sha256"] = rec["sha256"]
    neither = copy.deepcopy(ok)
    del neither["source"]["files"][0]["chunks"]
    for bad in (both, neither):
        assert not validator.is_valid(bad)


def test_schema_rejects_bad_manifests(sidecars: dict[str, Path], validator) -> None:
    m = _manifest(next(iter(sidecars.values())))
    bad_version = {**m, "format_version": "2"}
    no_files = {k: v for k, v in m.items() if k != "files"}
    bad_profile = copy.deepcopy(m)
    bad_profile["target"]["profile"] = "w4a16"
    bad_name = copy.deepcopy(m)
    bad_name["files"][0]["name"] = "../escape.safetensors"
    local_without_path = copy.deepcopy(m)
    del local_without_path["source"]["path"]
    fuse_none_tp2 = copy.deepcopy(m)
    fuse_none_tp2["target"].update(fusion="none", tp_size=2)
    for bad in (bad_version, no_files, bad_profile, bad_name, local_without_path, fuse_none_tp2):
        assert not validator.is_valid(bad)


def test_example_manifest_matches_the_schema(validator) -> None:
    examples = [json.loads(b) for b in _blocks("json") if '"$schema"' not in b]
    examples = [e for e in examples if e.get("format") == "mpack-sidecar"]
    assert examples, "FORMAT.md should show an example manifest"
    for e in examples:
        assert not [x.message for x in validator.iter_errors(e)]


def test_digest_is_sha256_of_the_manifest_bytes(sidecars: dict[str, Path]) -> None:
    for sidecar in sidecars.values():
        raw = (sidecar / MANIFEST_NAME).read_bytes()
        m, digest = load_manifest(sidecar)
        assert digest == hashlib.sha256(raw).hexdigest() == digest_of(m)
        assert raw == (json.dumps(m, indent=2, sort_keys=True) + "\n").encode()


def test_header_metadata_is_as_documented(sidecars: dict[str, Path]) -> None:
    for sidecar in sidecars.values():
        t = _manifest(sidecar)["target"]
        base = {"format": "mpack-sidecar", "format_version": "2", "tp_size": str(t["tp_size"]),
                "profile": t["profile"], "act_dtype": t["act_dtype"]}  # fmt: skip
        for r in range(t["tp_size"]):
            meta = read_layout(sidecar / rank_file_name(r, t["tp_size"])).metadata
            assert meta == {**base, "rank": str(r)}
        if (sidecar / COMMON_NAME).is_file():
            common = read_layout(sidecar / COMMON_NAME).metadata
            assert common == {**base, "content": "pass-through"}


# --- (b) the stdlib reader -----------------------------------------------------------------


def test_reader_matches_read_layout(sidecars: dict[str, Path], read_sidecar) -> None:
    for sidecar in sidecars.values():
        m = _manifest(sidecar)
        tp = m["target"]["tp_size"]
        for r in range(tp):
            fname = rank_file_name(r, tp)
            got = read_sidecar(sidecar, rank=r)
            want = {e.name: (e.dtype, tuple(e.shape), fname, e.offset, e.nbytes)
                    for e in read_layout(sidecar / fname).entries}  # fmt: skip
            assert got == want
            for dtype, shape, _, offset, nbytes in got.values():
                assert dtype in ("I32", "F16", "BF16") and len(shape) in (1, 2)
                if nbytes % ALIGN == 0:
                    assert offset % ALIGN == 0
        for f in m["files"]:
            if f["name"].endswith(".safetensors"):
                layout = read_layout(sidecar / f["name"])
                assert layout.entries[0].offset % ALIGN == 0
                for e in layout.entries:
                    assert e.nbytes % ALIGN or e.offset % ALIGN == 0, (f["name"], e.name)


def test_reader_refuses_other_versions_and_bad_bytes(
    sidecars: dict[str, Path], read_sidecar, tmp_path: Path
) -> None:
    src = next(iter(sidecars.values()))
    old = tmp_path / "old"
    shutil.copytree(src, old)
    m = _manifest(old)
    (old / MANIFEST_NAME).write_text(json.dumps({**m, "format_version": 99}))
    with pytest.raises(ValueError, match=r"mpack convert <source> -o .* --force"):
        read_sidecar(old)
    with pytest.raises(FormatVersionError) as e:
        load_manifest(old)
    assert e.value.hint.endswith(f"mpack convert {m['source']['path']} -o {old} --force")

    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    rank0 = bad / rank_file_name(0, m["target"]["tp_size"])
    data = bytearray(rank0.read_bytes())
    data[-1] ^= 0xFF
    rank0.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="sha256"):
        read_sidecar(bad)
