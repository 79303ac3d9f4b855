"""Every backend usable here converts the golden cases bit for bit, and each writes the bytes of
the others (Note [choosing a backend] in mpack/convert/backends/__init__.py).

One matrix, through the seam a caller uses (``ConvertOptions.backend`` and ``disable``): no
environment forcing. On this machine the CPU rows run; the GPU rows (``gpu``: the driver backend,
torch on CUDA with the fused kernel and with torch's ops) run under ``make test-gpu``. The
chooser's rules (the order per device, refusals and their reasons, the switches read from the
environment) are tested here too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from mpack.convert import host_repack
from mpack.convert.backends import SWITCHES, disabled_by_env, open_backend, prefetch_files
from mpack.convert.options import ConvertOptions
from mpack.convert.pipeline import run_convert
from mpack.errors import UsageError
from mpack.fixtures import make_checkpoint
from tests.conftest import _golden_dir
from tests.convert.helpers import (
    HOST_MODELS,
    cli,
    plan_of,
    safetensors_bytes,
    same_bytes,
    tensors,
)


@dataclass(frozen=True)
class Row:
    """One backend as a caller asks for it, and what it must report running."""

    id: str
    backend: str
    device: str
    disable: frozenset[str]
    detail: str  # a word of the backend's ``detail``
    gpu: bool = False
    native: bool = False  # needs the native repack built

    def options(self, **kw) -> ConvertOptions:
        return ConvertOptions(device=self.device, backend=self.backend, disable=self.disable, **kw)

    def param(self):
        marks = [pytest.mark.gpu] if self.gpu else []
        if self.native and not host_repack.available():
            marks.append(pytest.mark.skip(reason="the native repack is not built here"))
        return pytest.param(self, id=self.id, marks=marks)


NONE: frozenset[str] = frozenset()
ROWS = [
    Row("host", "host", "cpu", NONE, "native repack", native=True),
    Row("torch-cpu-native", "torch", "cpu", NONE, "native repack", native=True),
    Row("torch-cpu-ops", "torch", "cpu", frozenset({"native-repack"}), "torch's ops"),
    Row("driver", "driver", "cuda", NONE, "kernel", gpu=True, native=True),
    Row("torch-cuda-kernel", "torch", "cuda", NONE, "kernel", gpu=True),
    Row("torch-cuda-ops", "torch", "cuda", frozenset({"cuda-kernel"}), "torch's ops", gpu=True),
]
TORCH_ROWS = [r for r in ROWS if r.backend == "torch"]


def _cases() -> list[Path]:
    root = _golden_dir() / "cases"
    return sorted(p for p in root.iterdir() if (p / "case.json").is_file())


def _ran(r, row: Row) -> None:
    where = "cpu" if row.device == "cpu" else "cuda:0"
    assert (r.backend["name"], r.backend["device"]) == (row.backend, where), r.backend
    assert row.detail in r.backend["detail"], r.backend


@pytest.mark.parametrize("row", [r.param() for r in ROWS])
@pytest.mark.parametrize("case_dir", _cases(), ids=lambda p: p.name)
def test_golden_case_on_each_backend(row: Row, case_dir: Path, tmp_path: Path):
    case = json.loads((case_dir / "case.json").read_text())
    opts = row.options(profile=case["profile"], act_dtype=case["act_dtype"], tp=case["tp"])
    src, out = case_dir / case["input"], tmp_path / "out"
    if case["profile"] == "w8a8-marlin" and row.backend != "torch":
        # requantizing per-tensor shards is the torch backend's: asked for, the others refuse
        with pytest.raises(UsageError, match="requantizing per-tensor shards") as e:
            run_convert(src, out, opts)
        assert e.value.exit_code == 2 and not out.exists()
        return
    r = run_convert(src, out, opts)
    _ran(r, row)
    for name in case["expected_files"]:
        got, exp = tensors(out / name), tensors(case_dir / "expected" / name)
        assert got.keys() == exp.keys(), name
        for k in exp:
            assert same_bytes(got[k], exp[k]), f"{row.id} {name}: {k}"


def _moe_cases() -> list[Path]:
    root = _golden_dir().parent / "golden-moe" / "cases"
    return sorted(p for p in root.iterdir() if (p / "case.json").is_file())


@pytest.mark.parametrize("batch", ["default", "mixed", "none"])
@pytest.mark.parametrize("row", [r.param() for r in ROWS])
@pytest.mark.parametrize("case_dir", _moe_cases(), ids=lambda p: p.name)
def test_moe_golden_case_on_each_backend(
    row: Row, case_dir: Path, batch: str, tmp_path: Path, monkeypatch
):
    """vLLM's MoE tensors from every backend, with the experts in batches of the whole block
    (``default``), of 3 down projections and 1 gate/up pair (``mixed``: batches that end inside
    a block, and batches of one; on a GPU through 8 KiB pinned pieces, 3 to a ring, so that a
    piece holds parts of several experts), and one by one (``none``): Note [expert batches] in
    mpack/convert/stream.py. Per-tensor experts are requantized: the torch backend's."""
    from mpack.convert import stream

    case = json.loads((case_dir / "case.json").read_text())
    make = case["make"]
    limits = {"default": stream.BATCH_BYTES, "mixed": 3 * make["hidden"] * make["moe_intermediate"]}
    monkeypatch.setattr(stream, "BATCH_BYTES", limits.get(batch, 0))
    if batch == "mixed" and row.gpu and row.backend == "torch":
        from mpack.convert.backends import torch as torch_backend

        for name, value in (("PIECE", 8192), ("IN_PIECES", 3), ("OUT_PIECES", 3)):
            monkeypatch.setattr(torch_backend, name, value)
    opts = row.options(profile=case["profile"], act_dtype=case["act_dtype"], tp=case["tp"])
    out = tmp_path / "out"
    if make["scheme"] == "FP8" and row.backend != "torch":
        with pytest.raises(UsageError, match="requantizing per-tensor shards"):
            run_convert(case_dir / "input", out, opts)
        return
    r = run_convert(case_dir / "input", out, opts)
    _ran(r, row)
    name = "rank-00-of-01.safetensors"
    got, want = tensors(out / name), tensors(case_dir / "expected" / name)
    assert sorted(got) == sorted(want)
    for k in want:
        assert same_bytes(got[k], want[k]), f"{row.id} {case_dir.name}: {k}"


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("backends")
    return {name: make_checkpoint(root / name, **kw) for name, kw in HOST_MODELS.items()}


#: Layer kinds the golden cases lack: fused biases (F16, F32 stored), FP16 channel scales, TP 2.
CONVERSIONS = [
    ("tensor", "w8a16", "bfloat16", 2),
    ("channel-f16", "w8a16", "float16", 1),
    ("bias", "w8a16", "float16", 2),
    ("bias-f32", "w8a16", "bfloat16", 2),
    ("tensor", "w8a8-marlin", "float16", 2),
]


@pytest.mark.parametrize("row", [r.param() for r in ROWS if r.id != "torch-cpu-ops"])
@pytest.mark.parametrize("model, profile, act, tp", CONVERSIONS, ids=lambda v: str(v))
def test_each_backend_writes_the_same_sidecar(models, tmp_path, row, model, profile, act, tp):
    """Against torch's ops on the CPU, the slowest and plainest: every byte and the manifest's
    file records (the digest of every chunk)."""
    if profile == "w8a8-marlin" and row.backend != "torch":
        pytest.skip("requantization is the torch backend's (refusal: the golden test)")
    kw = dict(profile=profile, act_dtype=act, tp=tp)
    ref = run_convert(models[model], tmp_path / "ref", ROWS[2].options(**kw))
    _ran(ref, ROWS[2])
    r = run_convert(models[model], tmp_path / row.id, row.options(**kw))
    _ran(r, row)
    assert r.manifest["files"] == ref.manifest["files"]
    assert safetensors_bytes(r.out) == safetensors_bytes(ref.out)


@pytest.mark.parametrize("row", [r.param() for r in ROWS])
def test_verify_rederives_on_each_backend(models, tmp_path, row):
    """Re-derivation opens the backend a conversion would (the same seam) and passes."""
    from mpack.verify import verify

    sc = run_convert(models["bias"], tmp_path / "sc", ConvertOptions(tp=2, device="cpu")).out
    res = verify(
        sc, source=models["bias"], rederive_device=row.device, rederive_backend=row.backend
    )
    assert res.ok and res.source_checked, res.problems
    assert res.rederive_device == ("cpu" if row.device == "cpu" else "cuda:0")


# --- the chooser ------------------------------------------------------------------------------


def test_the_switches_are_read_from_the_environment_in_one_place(monkeypatch):
    for var in SWITCHES.values():
        monkeypatch.delenv(var, raising=False)
    assert disabled_by_env() == frozenset()
    monkeypatch.setenv("MPACK_NO_HOST_REPACK", "1")
    monkeypatch.setenv("MPACK_NO_CUDA_KERNEL", "0")  # 0: not set
    assert disabled_by_env() == frozenset({"native-repack"})


@pytest.mark.skipif(not host_repack.available(), reason="the native repack is not built here")
def test_cpu_tries_host_then_torch_and_says_why(models, monkeypatch):
    monkeypatch.setenv("MPACK_NO_HOST_REPACK", "1")
    plan = plan_of(models["tensor"])
    b = open_backend("cpu", plan)
    try:
        assert (b.name, b.where) == ("torch", "cpu") and "torch's ops" in b.detail
        assert b.refused == {"host (cpu)": "turned off (MPACK_NO_HOST_REPACK)"}
    finally:
        b.close()
    monkeypatch.delenv("MPACK_NO_HOST_REPACK")
    b = open_backend("cpu", plan)
    try:
        assert (b.name, b.refused) == ("host", {})
    finally:
        b.close()


def test_a_backend_asked_for_that_cannot_run_is_a_usage_error(models):
    plan = plan_of(models["tensor"])
    # the API's words (Note [API wording]); the CLI says --backend host, --device cpu
    with pytest.raises(UsageError, match="backend='host' cannot .*MPACK_NO_HOST_REPACK") as e:
        open_backend("cpu", plan, backend="host", disabled=frozenset({"native-repack"}))
    assert e.value.exit_code == 2 and "leave backend at auto" in (e.value.hint or "")
    with pytest.raises(UsageError, match="backend='driver' does not run on device='cpu'") as e:
        open_backend("cpu", plan, backend="driver")
    assert "device='cuda'" in (e.value.hint or "")
    with pytest.raises(UsageError, match="backend must be auto or one of"):
        open_backend("cpu", plan, backend="rocm")
    with pytest.raises(UsageError, match="cannot turn off"):
        open_backend("cpu", plan, disabled=frozenset({"everything"}))


def test_a_backend_opened_for_one_target_serves_the_next(models):
    """Several targets of one run share what they can (``opened``); a plan the open backend does
    not take gets the next candidate."""
    a = open_backend("cpu", plan_of(models["tensor"]))
    try:
        b = open_backend("cpu", plan_of(models["tensor"], tp=2), opened=[a])
        assert b is a
        c = open_backend("cpu", plan_of(models["tensor"], profile="w8a8-marlin"), opened=[a])
        try:
            assert c is not a and c.name == "torch"
        finally:
            c.close()
    finally:
        a.close()


def test_prefetch_list_is_the_backends(monkeypatch):
    assert prefetch_files("cpu") == [] and prefetch_files("auto") == []
    assert prefetch_files("nonsense") == []
    from mpack import cudadrv

    monkeypatch.setattr(cudadrv, "library_files", lambda: [Path("/lib/libcuda.so.1")])
    assert prefetch_files("cuda:1") == [Path("/lib/libcuda.so.1")]


def test_verify_opens_a_backend_not_the_orchestrator():
    """Re-derivation opens its backend through :func:`open_backend` like a conversion, and no
    module of verify/ imports convert's orchestrator (pipeline) to borrow its logic."""
    from tests.test_import_rules import imports_of, library_modules

    found = [
        f"{name}:{line} imports {imported}"
        for name, path in library_modules().items()
        if name.startswith("mpack.verify")
        for line, imported in imports_of(name, path)
        if imported == "mpack.convert.pipeline"
    ]
    assert not found, found


def test_the_cli_says_which_backend_ran_and_why(models, tmp_path):
    """``mpack -v convert`` names the backend and each refusal before it; ``--json`` has them
    as ``backend``; ``--backend`` asks for one, and one that cannot run exits 2, nothing written."""
    ck = models["tensor"]
    off = {"MPACK_NO_HOST_REPACK": "1"}
    r = cli("-v", "convert", ck, "-o", tmp_path / "a", "--device", "cpu", env=off)
    assert r.returncode == 0, r.stderr
    assert "backend torch on cpu: weights repacked by torch's ops" in r.stderr, r.stderr
    assert "not host (cpu): turned off (MPACK_NO_HOST_REPACK)" in r.stderr, r.stderr
    r = cli("convert", ck, "-o", tmp_path / "b", "--device", "cpu", "--backend", "torch", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["backend"]["name"] == "torch" and doc["backend"]["device"] == "cpu"
    r = cli("convert", ck, "-o", tmp_path / "c", "--device", "cpu", "--backend", "driver")
    assert r.returncode == 2 and "--backend driver does not run on --device cpu" in r.stderr
    assert not (tmp_path / "c").exists()
