"""``mpack verify --source`` in one pass (verify/compare.py, verify/rederive.py): each sidecar byte
read once serves its chunk digest and the comparison with the re-derived bytes; whatever is
damaged is named by file and tensor, on the CPU and (``gpu``) on CUDA alike."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

import mpack.convert as mc
from mpack import iokit
from mpack.iokit import chunk_digests
from mpack.sidecar import (
    COMMON_NAME,
    FileMap,
    HashingWriter,
    TensorSpec,
    check_files,
    load_manifest,
    rank_file_name,
    read_file_map,
    write_manifest,
)
from mpack.verify import compare, verify
from mpack.verify.compare import SidecarComparer
from tests.conftest import flip_byte

RANK0 = rank_file_name(0, 1)
LAYER = "model.layers.0.mlp.gate_up_proj"  # a fused layer of the fixture (vLLM names)


def _copy(sc: Path, dst: Path) -> Path:
    return Path(shutil.copytree(sc, dst))


def _resign(sc: Path, name: str) -> None:
    """Make mpack.json's chunk digests of ``name`` those of the file as it is now."""
    m, _ = load_manifest(sc)
    (entry,) = [f for f in m["files"] if f["name"] == name]
    entry["chunks"]["sha256"] = chunk_digests(sc / name, entry["chunks"]["bytes"])
    write_manifest(sc, m)


def _flip_in(sc: Path, fname: str, tensor: str, *, resign: bool = True) -> None:
    """Flip a byte in the middle of ``tensor`` of sidecar file ``fname``."""
    e = read_file_map(sc / fname).entry(tensor)
    flip_byte(sc / fname, e.offset + e.nbytes // 2)
    if resign:
        _resign(sc, fname)


def _header_pad(path: Path) -> int:
    """The offset of the last byte of the header's space padding."""
    file_map = read_file_map(path)
    assert file_map.header.endswith(b" "), "the fixture's header is padded"
    return file_map.data_start - 1


def _damaged(converted, tmp_path: Path) -> dict[str, Path]:
    """One damaged copy of the sidecar per kind of damage."""
    _, sc = converted
    cases = {}
    for case in ("weight", "scale", "passthrough", "header", "chunk"):
        cases[case] = _copy(sc, tmp_path / case)
    _flip_in(cases["weight"], RANK0, f"{LAYER}.weight")
    _flip_in(cases["scale"], RANK0, f"{LAYER}.weight_scale")
    _flip_in(cases["passthrough"], COMMON_NAME, "model.embed_tokens.weight")
    # a space of the padding becomes a tab: the header still parses, only the digest tells
    flip_byte(cases["header"] / RANK0, _header_pad(cases["header"] / RANK0), mask=0x20 ^ 0x09)
    _flip_in(cases["chunk"], RANK0, f"{LAYER}.weight", resign=False)
    return cases


def _problems(
    converted, tmp_path: Path, device: str, backend: str = "auto"
) -> dict[str, list[str]]:
    ck, _ = converted
    out = {}
    for case, sc in _damaged(converted, tmp_path).items():
        r = verify(sc, source=ck, rederive_device=device, rederive_backend=backend)
        assert not r.ok, case
        out[case] = r.problems
        if case in ("header", "chunk"):  # a digest that differs: reported as check 1 reports it
            assert not r.source_checked and r.problems == check_files(sc, load_manifest(sc)[0])
        else:
            assert r.source_checked and r.report()["rederive_device"] == device
    return out


def _assert_named(problems: dict[str, list[str]]) -> None:
    assert problems["weight"] == [
        f"{RANK0}: {LAYER}.weight differs from the tensor re-derived from the source",
        f"{RANK0}: {LAYER}.weight does not unpack to the checkpoint bytes",
    ]
    assert problems["scale"] == [
        f"{RANK0}: {LAYER}.weight_scale differs from the tensor re-derived from the source",
        f"{RANK0}: {LAYER}.weight_scale does not unpack to the checkpoint scales",
    ]
    assert problems["passthrough"] == [
        f"{COMMON_NAME}: model.embed_tokens.weight differs from the source bytes"
    ]
    for case in ("header", "chunk"):
        (p,) = problems[case]
        assert p.startswith(f"{RANK0}: sha256 of bytes 0..") and "manifest says" in p, p


def test_a_good_sidecar_passes_on_the_cpu(converted) -> None:
    ck, sc = converted
    r = verify(sc, source=ck, rederive_device="cpu")
    assert r.ok and r.source_checked and r.problems == []
    assert r.report()["rederive_device"] == "cpu"
    assert r.layers_checked == 4 and r.tensors_compared > r.layers_checked
    assert r.report() == mc.verify(sc, source=ck).report() | {"rederive_device": "cpu"}


def test_the_pass_names_the_file_and_tensor_of_each_damage_on_the_cpu(converted, tmp_path) -> None:
    _assert_named(_problems(converted, tmp_path, "cpu"))


@pytest.mark.gpu
def test_cuda_finds_the_same_problems_as_the_cpu(converted, tmp_path) -> None:
    ck, sc = converted
    r = verify(sc, source=ck, rederive_device="cuda")
    assert r.ok and r.report()["rederive_device"].startswith("cuda")
    on_cpu = _problems(converted, tmp_path / "cpu", "cpu")
    on_cuda = _problems(converted, tmp_path / "cuda", "cuda:0")
    assert on_cuda == on_cpu
    _assert_named(on_cuda)


def test_an_unknown_rederive_device_is_a_usage_error(converted) -> None:
    from mpack.errors import UsageError

    ck, sc = converted
    # the API's words (Note [API wording]); the CLI says --rederive-device
    with pytest.raises(UsageError, match="rederive_device must be auto, cpu, cuda or cuda:<i>"):
        verify(sc, source=ck, rederive_device="tpu")
    if not _cuda_here():
        with pytest.raises(UsageError, match="rederive_device='cuda': no CUDA device here") as e:
            verify(sc, source=ck, rederive_device="cuda")
        assert e.value.hint == "use rederive_device='cpu' (identical bytes)"


def _cuda_here() -> bool:
    import torch

    return torch.cuda.is_available()


def test_a_source_that_changed_is_named(converted, tmp_path) -> None:
    ck, sc = converted
    src = Path(shutil.copytree(ck, tmp_path / "ck"))
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(cfg, indent=1))  # same config, other bytes
    r = verify(sc, source=src)
    assert r.problems == ["source config.json: differs from the file the sidecar was made from"]


# --- the comparer on its own: chunks smaller than a tensor, any order ---------------------------


def _file(tmp_path: Path, chunk: int) -> tuple[Path, FileMap, dict]:
    """A safetensors file of three tensors, its layout and its files record (``chunk`` bytes)."""
    specs = [
        TensorSpec("a", "U8", (3000,)),
        TensorSpec("b", "U8", (1280,)),
        TensorSpec("c", "U8", (77,)),
    ]
    file_map = FileMap.plan(specs)
    path = tmp_path / "f.safetensors"
    w = HashingWriter(path, file_map, chunk_bytes=chunk)
    for e in file_map.entries:
        w.write_at(e.offset, _bytes_of(e.name, e.nbytes))
    size, _ = w.finish()
    return (
        path,
        file_map,
        {"name": path.name, "size": size, "chunks": {"bytes": chunk, "sha256": w.chunks}},
    )


def _bytes_of(name: str, n: int) -> bytes:
    return bytes((ord(name) * 7 + i) % 251 for i in range(n))


def _run(path, planned, found, record, writes) -> SidecarComparer:
    with iokit.pool("t", 2) as p, iokit.pool("t-ordered", 1) as o:
        c = SidecarComparer(path, planned, found, record, pool=p, ordered=o)
        for e in writes:
            c.write_at(e.offset, memoryview(_bytes_of(e.name, e.nbytes)))
        c.problems = c.finish()  # type: ignore[attr-defined]
    return c


@pytest.mark.parametrize("piece", [64, 1000, 1 << 20])
def test_the_comparer_hashes_every_byte_once_whatever_the_pieces(tmp_path, monkeypatch, piece):
    monkeypatch.setattr(compare, "READ_BYTES", piece)
    path, file_map, record = _file(tmp_path, chunk=1000)
    c = _run(path, file_map, file_map, record, file_map.entries)
    assert c.problems == [] and not c.differs  # type: ignore[attr-defined]
    # writes out of order (a sidecar laid out otherwise): still every byte compared and hashed
    c = _run(path, file_map, file_map, record, list(reversed(file_map.entries)))
    assert c.problems == [] and not c.differs  # type: ignore[attr-defined]
    # a tensor left unwritten is read and hashed all the same
    c = _run(path, file_map, file_map, record, file_map.entries[:1])
    assert c.problems == [] and not c.differs  # type: ignore[attr-defined]


def test_the_comparer_names_the_tensor_and_the_chunk(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(compare, "READ_BYTES", 512)
    path, file_map, record = _file(tmp_path, chunk=1000)
    b = file_map.entry("b")
    flip_byte(path, b.offset + 5)
    c = _run(path, file_map, file_map, record, file_map.entries)
    assert list(c.differs) == ["b"]
    (p,) = c.problems  # type: ignore[attr-defined]
    lo = (b.offset + 5) // 1000 * 1000
    assert p.startswith(f"{path.name}: sha256 of bytes {lo}..{lo + 1000} is ")
    assert p.endswith(f"(1 of {len(record['chunks']['sha256'])} chunks differ)")


def test_the_comparer_reports_a_planned_tensor_the_file_holds_otherwise(tmp_path) -> None:
    path, file_map, record = _file(tmp_path, chunk=1 << 20)
    planned = FileMap.plan(
        [
            TensorSpec("a", "U8", (3000,)),
            TensorSpec("b", "U8", (640, 2)),
            TensorSpec("d", "U8", (8,)),
        ]
    )
    c = _run(path, planned, file_map, record, planned.entries)
    assert c.unmatched == ["b", "d"] and c.unplanned == ["b", "c"]
    assert c.problems == [] and not c.differs  # type: ignore[attr-defined]


def test_cli_says_where_it_rederived(converted) -> None:
    """`mpack verify --rederive-device cpu`: the human line and the JSON name the device; the
    JSON also says how long each phase took."""
    import subprocess
    import sys

    ck, sc = converted
    base = [sys.executable, "-m", "mpack", "verify", str(sc), "--source", str(ck)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    human = subprocess.run(
        [*base, "--rederive-device", "cpu"], capture_output=True, text=True, timeout=300, env=env
    )
    assert human.returncode == 0, human.stderr
    assert "(on cpu) are byte-identical" in human.stdout
    doc = subprocess.run(
        [*base, "--rederive-device", "cpu", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert doc.returncode == 0, doc.stderr
    got = json.loads(doc.stdout)
    assert got["rederive_device"] == "cpu"
    # where the time went, for profiling: every phase of a re-derivation, inside the total
    phases = got["seconds"]
    assert {"files", "plan", "pass", "wait_scheme_check", "total"} <= set(phases)
    assert "import_torch" not in phases  # the host path (Note [verify without torch])
    assert all(v >= 0 for v in phases.values())
    assert sum(v for k, v in phases.items() if k != "total") <= phases["total"] + 1e-3


def test_a_cpu_verify_never_imports_torch(converted) -> None:
    """Note [verify without torch]: a fresh process verifies a good sidecar against its source
    on the host path and leaves torch unimported."""
    import subprocess
    import sys

    ck, sc = converted
    code = (
        "import json, sys; from mpack.cli import main\n"
        "try:\n    main()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
        "print(json.dumps('torch' in sys.modules))"
    )
    args = ["verify", str(sc), "--source", str(ck), "--rederive-device", "cpu"]
    r = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "byte-identical" in out
    assert json.loads(out.strip().splitlines()[-1]) is False, out


def test_the_torch_backend_finds_the_same_problems(converted, tmp_path) -> None:
    """Re-derived on the torch backend, verify finds the same words for every damage, and the
    torch import shows in the phases."""
    ck, sc = converted
    on_host = _problems(converted, tmp_path / "host", "cpu")
    r = verify(sc, source=ck, rederive_device="cpu", rederive_backend="torch")
    assert r.ok and "import_torch" in r.seconds
    assert _problems(converted, tmp_path / "torch", "cpu", "torch") == on_host
