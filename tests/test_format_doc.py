"""docs/FORMAT.md agrees with what mpack writes: its JSON Schema, its examples, its tables and
ordering rules, and its reader.

Real sidecars: every golden case converted with its options, plus real checkpoints of
mpack.fixtures converted here. The doc's examples are parsed out of the doc and compared with
those conversions value by value, so an example that drifts from the writer fails here.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
import shutil
import struct
from pathlib import Path
from typing import Any

import pytest

from mpack.convert.options import ConvertOptions
from mpack.convert.pipeline import run_convert
from mpack.convert.source import ResolvedSource, provenance
from mpack.errors import FormatVersionError
from mpack.fixtures import make_checkpoint
from mpack.sidecar import (
    ALIGN,
    COMMON_NAME,
    FORMAT_VERSION,
    MANIFEST_NAME,
    SOURCE_CARD_KEYS,
    digest_of,
    load_manifest,
    rank_file_name,
    read_file_map,
)
from tests.conftest import REPO

jsonschema = pytest.importorskip("jsonschema")  # a dev dependency; the GPU machine lacks it

DOC = REPO / "docs" / "FORMAT.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```\s*$", re.S | re.M)


def _blocks(lang: str, text: str | None = None) -> list[str]:
    text = DOC.read_text() if text is None else text
    return [m.group(2) for m in FENCE.finditer(text) if m.group(1) == lang]


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
    """Every golden case converted with its options, one with --fuse none --no-passthrough, and
    an 11-layer checkpoint (so natural order differs from string order) under both fusions."""
    root = tmp_path_factory.mktemp("sidecars")
    out = {}
    cases = sorted(p for p in (golden / "cases").iterdir() if (p / "case.json").is_file())
    assert cases
    for case in cases:
        opts = json.loads((case / "case.json").read_text())
        if opts.get("expect", "convert") != "convert":
            continue
        run_convert(
            case / opts.get("input", "input"),
            root / case.name,
            ConvertOptions(
                profile=opts["profile"],
                act_dtype=opts["act_dtype"],
                tp=opts["tp"],
                fuse=opts.get("fusion", "vllm"),
                device="cpu",
            ),
        )
        out[case.name] = root / case.name
    first = cases[0] / "input"
    run_convert(
        first,
        root / "fuse-none",
        ConvertOptions(
            profile="w8a16",
            act_dtype="bfloat16",
            tp=1,
            fuse="none",
            device="cpu",
            passthrough=False,
        ),
    )
    out["fuse-none"] = root / "fuse-none"
    eleven = make_checkpoint(
        root / "eleven-ckpt",
        layers=11,
        hidden=64,
        intermediate=128,
        heads=2,
        kv_heads=1,
        vocab=128,
        scheme="FP8_DYNAMIC",
    )
    for fuse in ("vllm", "none"):
        run_convert(
            eleven,
            root / f"eleven-{fuse}",
            ConvertOptions(profile="w8a16", act_dtype="bfloat16", tp=1, fuse=fuse, device="cpu"),
        )
        out[f"eleven-{fuse}"] = root / f"eleven-{fuse}"
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
        src = ResolvedSource(
            path=Path("/cache/snap"),
            kind="hub",
            repo="org/name",
            revision=revision,
            requested=requested,
        )
        hub = {**m, "source": provenance(src, m["source"]["files"])}
        assert not list(validator.iter_errors(hub))


def test_card_keys_match_the_schema_and_the_reader(
    sidecars: dict[str, Path], validator, tmp_path: Path
) -> None:
    """The optional ``source`` keys of Note [card facts]: the schema and ``check_manifest``
    take the same values, and refuse the same."""
    from mpack.errors import CorruptFileError
    from mpack.sidecar import check_manifest

    m = _manifest(next(iter(sidecars.values())))
    facts = {
        "base_model": "org/Llama-FP8",
        "license": "other",
        "license_name": "llama3.1",
        "license_link": "https://huggingface.co/org/Llama-FP8/blob/main/LICENSE",
    }
    ok = {**m, "source": {**m["source"], **facts}}
    assert not list(validator.iter_errors(ok))
    check_manifest(ok, tmp_path / MANIFEST_NAME)
    bad = {**m, "source": {**m["source"], "license": "mit\n## Serve"}}
    assert not validator.is_valid(bad)
    with pytest.raises(CorruptFileError, match="source license"):
        check_manifest(bad, tmp_path / MANIFEST_NAME)


def test_source_files_by_chunks_match_the_schema(sidecars: dict[str, Path], validator) -> None:
    """Note [source digests]: a source file is recorded by sha256 or by chunks, never both or
    neither."""
    m = _manifest(next(iter(sidecars.values())))
    rec = m["source"]["files"][0]
    chunked = {
        "name": rec["name"],
        "size": 3 * 2**26 + 5,
        "chunks": {"bytes": 2**26, "sha256": [rec["sha256"]] * 4},
    }
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
        base = {
            "format": "mpack-sidecar",
            "format_version": "2",
            "tp_size": str(t["tp_size"]),
            "profile": t["profile"],
            "act_dtype": t["act_dtype"],
        }
        for r in range(t["tp_size"]):
            meta = read_file_map(sidecar / rank_file_name(r, t["tp_size"])).metadata
            assert meta == {**base, "rank": str(r)}
        if (sidecar / COMMON_NAME).is_file():
            common = read_file_map(sidecar / COMMON_NAME).metadata
            # no target keys: the same bytes in every target (Note [shared uploads])
            assert common == {
                "format": "mpack-sidecar",
                "format_version": "2",
                "content": "pass-through",
            }


# --- (b) the stdlib reader -----------------------------------------------------------------


def test_reader_matches_read_file_map(sidecars: dict[str, Path], read_sidecar) -> None:
    for sidecar in sidecars.values():
        m = _manifest(sidecar)
        tp = m["target"]["tp_size"]
        for r in range(tp):
            fname = rank_file_name(r, tp)
            got = read_sidecar(sidecar, rank=r)
            want = {
                e.name: (e.dtype, tuple(e.shape), fname, e.offset, e.nbytes)
                for e in read_file_map(sidecar / fname).entries
            }
            assert got == want
            for dtype, shape, _, offset, nbytes in got.values():
                assert dtype in ("I32", "F16", "BF16") and len(shape) in (1, 2)
                if nbytes % ALIGN == 0:
                    assert offset % ALIGN == 0
        for f in m["files"]:
            if f["name"].endswith(".safetensors"):
                file_map = read_file_map(sidecar / f["name"])
                assert file_map.entries[0].offset % ALIGN == 0
                for e in file_map.entries:
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


# --- (c) the examples, the key tables and the ordering rules -------------------------------

NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]
ORDINALS = ["first", "second", "third", "fourth", "fifth"]
#: The tensors of one layer in a rank file, in the order the doc gives ("`weight`, ...").
LAYER_TENSORS = ("weight", "weight_scale", "bias")


def _natural(name: str) -> list[Any]:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def _by_index(m: dict[str, Any]) -> list[str]:
    return sorted(m["layers"], key=lambda name: m["layers"][name]["index"])


def _section(heading: str) -> str:
    """The doc's text under ``heading`` (a whole heading line), up to the next heading."""
    text = DOC.read_text()
    assert text.count(f"\n{heading}\n") == 1, heading
    return re.split(r"\n#+ ", text.split(f"\n{heading}\n", 1)[1], maxsplit=1)[0]


def _paragraph(start: str) -> str:
    (para,) = [p for p in DOC.read_text().split("\n\n") if p.startswith(start)]
    return " ".join(para.split())


def _table_after(lead: str) -> dict[str, str]:
    """The table right after the line ``lead``: each key of its first column -> its row."""
    text = DOC.read_text()
    assert text.count(f"\n{lead}\n") == 1, lead
    lines = text.split(f"\n{lead}\n", 1)[1].lstrip("\n").splitlines()
    end = next((i for i, line in enumerate(lines) if not line.startswith("|")), len(lines))
    out = {}
    for row in lines[2:end]:
        first = row.split("|")[1]
        for key in re.findall(r"`(\w+)`", first):
            out[key] = row
    return out


@pytest.fixture(scope="module")
def example() -> tuple[str, dict[str, Any]]:
    """The "Example (abridged)" manifest and the prose before and after it."""
    section = _section("### Example (abridged)")
    (block,) = _blocks("json", section)
    return section.replace(block, ""), json.loads(block)


def test_schema_and_headings_are_for_the_current_version(schema: dict[str, Any]) -> None:
    v = FORMAT_VERSION
    assert DOC.read_text().splitlines()[0].endswith(f"(format_version {v})")
    assert schema["title"].endswith(f"format_version {v}"), schema["title"]
    assert schema["properties"]["format_version"]["const"] == v
    assert f"The manifest as mpack writes it for `format_version` {v} " in DOC.read_text()


def test_example_manifest_is_a_real_manifest_abridged(example, sidecars: dict[str, Path]) -> None:
    prose, ex = example
    (case,) = set(re.findall(r"golden case `([^`]+)`", prose))
    real = _manifest(sidecars[case])
    assert set(ex) == set(real)
    for key in ("format", "format_version", "created_by", "target", "model", "files"):
        assert ex[key] == real[key], key
    src, real_src = dict(ex["source"]), dict(real["source"])
    assert Path(src.pop("path")).parts[-3:] == Path(real_src.pop("path")).parts[-3:]
    assert src == real_src
    assert ex["layers"]
    for name, layer in ex["layers"].items():
        assert layer == real["layers"].get(name), name

    opts = re.search(r"converted with\s+`--tp (\d+) --act-dtype (\w+)`", prose)
    assert opts, "the example should say how it was converted"
    assert (int(opts[1]), opts[2]) == (real["target"]["tp_size"], real["target"]["act_dtype"])
    shown = re.search(r"(\w+) of its (\w+) layers are shown", prose)
    assert shown, "the example should say how many layers it shows"
    counts = (NUMBERS.index(shown[1]), NUMBERS.index(shown[2]))
    assert counts == (len(ex["layers"]), len(real["layers"]))
    which = re.findall(r"the (\w+), `(\w+)`", prose)
    assert len(which) == len(ex["layers"]), which
    order = _by_index(real)
    for ordinal, leaf in which:
        name = order[ORDINALS.index(ordinal)]
        assert name.endswith(f".{leaf}") and name in ex["layers"], (ordinal, leaf, order)

    note = re.search(
        r"Note `(\w+)` \((\w+) parallel\): `k` is (\d+), half of the model's (\d+), while `n` is "
        r"the full (\d+)",
        " ".join(prose.split()),
    )
    assert note, "the note on the row-parallel layer should stay checkable"
    (name,) = [n for n in ex["layers"] if n.endswith(f".{note[1]}")]
    layer, hidden = real["layers"][name], real["model"]["config"]["hidden_size"]
    assert layer["parallel"] == note[2]
    assert (layer["k"], hidden, layer["n"]) == (int(note[3]), int(note[4]), int(note[5]))
    assert layer["k"] == hidden // real["target"]["tp_size"] and layer["n"] == hidden


def test_byte_example_is_the_start_of_a_real_rank_file(sidecars: dict[str, Path]) -> None:
    para = _paragraph("Example (the start of `rank-")
    fname = re.match(r"Example \(the start of `([^`]+)`", para)[1]
    (case,) = re.findall(r"golden case `([^`]+)`", para)
    raw = (sidecars[case] / fname).read_bytes()
    first8 = re.search(r"first 8 bytes are `([0-9a-f ]+)`", para)[1]
    assert bytes.fromhex(first8) == raw[:8]
    (n,) = struct.unpack("<Q", raw[:8])
    assert int(re.search(r"\(`N` = (\d+)\)", para)[1]) == n
    start, blocks = map(int, re.search(r"starts at byte (\d+) = (\d+) x 64", para).groups())
    assert start == 8 + n == 64 * blocks
    first = re.search(
        r"first tensor, the weight of the layer with `index` 0, is `([^`]+)`, `(\w+)`, "
        r"`\[([\d, ]+)\]`, `data_offsets` `\[(\d+), (\d+)\]`, i\.e\. file bytes `\[(\d+), (\d+)\)`",
        para,
    )
    assert first, para
    name, dtype, shape = first[1], first[2], [int(d) for d in first[3].split(",")]
    begin, end, file_begin, file_end = (int(first[i]) for i in range(4, 8))
    header = json.loads(raw[8 : 8 + n])
    assert [k for k in header if k != "__metadata__"][0] == name
    assert header[name] == {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}
    assert (file_begin, file_end) == (8 + n + begin, 8 + n + end)
    assert name == f"{_by_index(_manifest(sidecars[case]))[0]}.weight"


def test_layer_index_order_is_as_documented(sidecars: dict[str, Path]) -> None:
    """The `index` row: fused layers in natural decoder-layer order, then forward-pass order
    within one; checkpoint names in natural order with --fuse none."""
    row = " ".join(
        _table_after("Each `layers` entry describes rank 0; every rank has the same dimensions:")[
            "index"
        ].split()
    )
    fused, unfused = row.split("Fusion `vllm`:", 1)[1].split("Fusion `none`:", 1)
    leaves = re.findall(r"`(\w+_proj)`", fused)
    assert leaves == ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"], leaves
    first_unfused = re.search(r"so `([\w.]+)` comes first", unfused)[1]

    def fused_key(name: str) -> tuple[Any, ...]:
        block, _, leaf = name.rpartition(".")
        return (_natural(block.rpartition(".")[0]), leaves.index(leaf))

    seen = set()
    for case, sidecar in sidecars.items():
        m = _manifest(sidecar)
        order = _by_index(m)
        assert [m["layers"][n]["index"] for n in order] == list(range(len(order))), case
        if m["target"]["fusion"] == "vllm":
            assert order == sorted(order, key=fused_key), case
        else:
            assert order == sorted(order, key=_natural), case
            assert order[0].endswith(f".{first_unfused}"), (case, order[0])
        if any(".layers.10." in name for name in order):
            seen.add(m["target"]["fusion"])
    assert seen == {"vllm", "none"}  # natural order checked where it differs from string order


def test_files_hold_tensors_in_the_documented_order(sidecars: dict[str, Path]) -> None:
    """64-multiples first, each group in the writer's order: rank files by `index`, then
    weight, weight_scale, bias; common.safetensors by name. Manifest `files` sorted by name."""
    for case, sidecar in sidecars.items():
        m = _manifest(sidecar)
        names = [f["name"] for f in m["files"]]
        assert names == sorted(names), case
        tp = m["target"]["tp_size"]
        writer = [
            f"{layer}.{t}"
            for layer in _by_index(m)
            for t in LAYER_TENSORS
            if t != "bias" or m["layers"][layer]["bias"]
        ]
        files = {rank_file_name(r, tp): writer for r in range(tp)}
        if COMMON_NAME in names:
            files[COMMON_NAME] = sorted(
                e.name for e in read_file_map(sidecar / COMMON_NAME).entries
            )
        for fname, order in files.items():
            entries = sorted(read_file_map(sidecar / fname).entries, key=lambda e: e.offset)
            size = {e.name: e.nbytes for e in entries}
            want = [t for t in order if size[t] % ALIGN == 0] + [
                t for t in order if size[t] % ALIGN
            ]
            assert [e.name for e in entries] == want, (case, fname)


def test_key_tables_list_the_real_keys(sidecars: dict[str, Path]) -> None:
    top = _table_after("digest section. Top-level keys:")
    target = _table_after("`target`, every key required:")
    source = _table_after("`source`:")
    layer = _table_after(
        "Each `layers` entry describes rank 0; every rank has the same dimensions:"
    )
    for case, sidecar in sidecars.items():
        m = _manifest(sidecar)
        assert set(top) == set(m), case
        assert set(target) == set(m["target"]), case
        for name, entry in m["layers"].items():
            # `experts` only on a MoE block's stacked layers (tests/convert/test_moe.py)
            assert set(layer) - {"experts"} == set(entry), (case, name)
        assert set(m["model"]) <= set(re.findall(r"`(\w+)`", top["model"])), case
        assert set(m["model"]["config"]) <= set(re.findall(r"`(\w+)`", top["model"])), case
        hub = provenance(
            ResolvedSource(
                path=Path("/cache/snap"),
                kind="hub",
                repo="org/name",
                revision="0" * 40,
                requested="main",
            ),
            [],
        )
        # the card's keys are optional: written only when found (Note [card facts])
        assert set(source) == set(m["source"]) | set(hub) | set(SOURCE_CARD_KEYS), case


def test_moe_manifest_matches_the_schema(validator, tmp_path: Path) -> None:
    """A MoE sidecar's manifest (stacked expert layers with ``experts``) is the schema's too."""
    from mpack.convert import convert
    from mpack.fixtures_moe import make_moe_checkpoint

    ck = make_moe_checkpoint(tmp_path / "ck", arch="qwen3_moe", layers=1)
    convert(ck, tmp_path / "sc", tp=2)
    m = _manifest(tmp_path / "sc")
    assert {ly.get("experts") for ly in m["layers"].values()} == {None, 4}
    errors = [e.message for e in validator.iter_errors(m)]
    assert not errors, errors
    m["layers"][next(n for n, ly in m["layers"].items() if "experts" in ly)]["experts"] = 0
    assert [e.message for e in validator.iter_errors(m)], "experts 0 must not validate"


def test_expert_parallel_manifest_matches_the_schema(validator, tmp_path: Path) -> None:
    """An expert-parallel target's manifest (``expert_parallel``: true, ``experts`` per rank) is
    the schema's too, and mpack's reader refuses the key as anything but true at TP >= 2."""
    from mpack.convert import convert
    from mpack.errors import CorruptFileError
    from mpack.fixtures_moe import make_moe_checkpoint
    from mpack.sidecar import check_manifest

    ck = make_moe_checkpoint(tmp_path / "ck", arch="qwen3_moe", layers=1)
    convert(ck, tmp_path / "sc", tp=2, ep=True)
    m = _manifest(tmp_path / "sc")
    assert m["target"]["expert_parallel"] is True
    assert {ly.get("experts") for ly in m["layers"].values()} == {None, 2}
    errors = [e.message for e in validator.iter_errors(m)]
    assert not errors, errors
    check_manifest(m, "mpack.json")
    for bad, tp in ((False, 2), ("yes", 2), (True, 1)):
        m["target"].update(expert_parallel=bad, tp_size=tp)
        with pytest.raises(CorruptFileError, match="expert_parallel"):
            check_manifest(m, "mpack.json")
    m["target"].update(expert_parallel="yes", tp_size=2)
    assert [e.message for e in validator.iter_errors(m)], "expert_parallel 'yes' must not validate"
