"""The streaming machinery of `convert`: the hashing writer, the scheme check, stage failures.

Real files, real threads, a real forked child (the scheme check), real checkpoints from
``make_checkpoint``.
"""

from __future__ import annotations

import hashlib
import os
import random
import threading
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("compressed_tensors")

from mpack.convert.checkpoint import (  # noqa: E402
    find_layers,
    layer_summary,
    open_checkpoint,
)
from mpack.convert.options import ConvertOptions  # noqa: E402
from mpack.convert.plan import make_plan  # noqa: E402
from mpack.convert.scheme_check import SchemeCheck  # noqa: E402
from mpack.convert.stream import Sink, Streamer  # noqa: E402
from mpack.errors import CorruptFileError, UnsupportedSchemeError  # noqa: E402
from mpack.fixtures import make_checkpoint  # noqa: E402
from mpack.iokit import chunk_digests  # noqa: E402
from mpack.sidecar import FileMap, HashingWriter, TensorSpec  # noqa: E402
from tests.convert.helpers import edit_config, weight_args  # noqa: E402


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("stream") / "ck"
    make_checkpoint(root)
    return root


# --- HashingWriter -----------------------------------------------------------------------


def _file_map(nbytes: int) -> FileMap:
    return FileMap.plan([TensorSpec("t", "U8", (nbytes,))], {})


@pytest.mark.parametrize("chunk", [1000, 4096, 1 << 20])
def test_writer_chunk_digests_and_sha_match_the_file(tmp_path: Path, chunk: int) -> None:
    """Chunk digests computed while writing = digests of the finished file, any chunk size."""
    n = 300_001
    file_map = _file_map(n)
    data = random.Random(chunk).randbytes(n)
    path = tmp_path / "f.safetensors"
    w = HashingWriter(path, file_map, chunk_bytes=chunk)
    w.FLUSH_BYTES = 10_000  # many write-behind requests on a small file
    off, entry = 0, file_map.entry("t")
    rng = random.Random(1)
    while off < n:
        step = min(rng.randint(1, 50_000), n - off)
        w.write_at(entry.offset + off, data[off : off + step])
        off += step
    size, sha = w.finish()
    body = path.read_bytes()
    assert size == len(body) == file_map.size
    assert body[entry.offset :] == data
    assert sha == hashlib.sha256(body).hexdigest()
    assert w.chunks == chunk_digests(path, chunk)
    assert len(w.chunks) == -(-size // chunk)


def test_writer_fence_lets_a_buffer_be_reused(tmp_path: Path) -> None:
    """A buffer rewritten right after its fence is set never leaks into the whole-file hash."""
    piece, count = 1 << 20, 24
    file_map = _file_map(piece * count)
    path = tmp_path / "f.safetensors"
    w = HashingWriter(path, file_map, chunk_bytes=None)
    bufs = [bytearray(piece) for _ in range(2)]
    fences: list[threading.Event | None] = [None, None]
    want = bytearray()
    for i in range(count):
        j = i % 2
        if fences[j] is not None:
            assert fences[j].wait(30)
        bufs[j][:] = bytes([i]) * piece
        want += bufs[j]
        w.write_at(file_map.entry("t").offset + i * piece, memoryview(bufs[j]))
        fences[j] = w.fence()
    size, sha = w.finish()
    assert path.read_bytes()[file_map.entry("t").offset :] == want
    assert sha == hashlib.sha256(path.read_bytes()).hexdigest()
    assert w.chunks == []


def test_writer_refuses_out_of_order_and_short_files(tmp_path: Path) -> None:
    file_map = _file_map(100)
    w = HashingWriter(tmp_path / "f", file_map)
    with pytest.raises(AssertionError, match="write at"):
        w.write_at(file_map.entry("t").offset + 1, b"x")
    w.write_at(file_map.entry("t").offset, b"x" * 50)
    with pytest.raises(AssertionError, match="wrote"):
        w.finish()
    w.close()


# --- the scheme check in a child ---------------------------------------------------------


def test_scheme_check_child_agrees_with_inline(ckpt: Path) -> None:
    inline = SchemeCheck(ckpt, background=False)
    child = SchemeCheck(ckpt, background=True)
    assert child.in_child and not inline.in_child
    got = child.result()
    assert got == inline.result()
    # the structural plan (no compressed-tensors) finds the same layers and strategies
    ck = open_checkpoint(ckpt, scheme=False)
    assert ck.qconfig is None
    assert layer_summary(find_layers(ck)) == got
    assert child._proc.exitcode == 0


@pytest.mark.parametrize(
    "edit, expect",
    [
        (
            lambda c: weight_args(c).update(strategy="group", group_size=128),
            "weight strategy 'group'",
        ),
        (lambda c: c["quantization_config"].update(ignore=["re:.*up_proj"]), "ignore lists"),
    ],
    ids=["group", "ignored"],  # integer and non-compressed-tensors schemes: refused from
)  # config.json already by the structural pass (test_first_contact, test_bad_inputs)
def test_scheme_check_child_reports_the_inline_error(
    ckpt: Path, tmp_path: Path, edit, expect
) -> None:
    """A config the structural plan accepts but compressed-tensors' models reject: the child
    reports the inline check's error class and message, word for word."""
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    edit_config(bad, edit)
    layer_summary(find_layers(open_checkpoint(bad, scheme=False)))  # structurally fine
    with pytest.raises(UnsupportedSchemeError) as inline:
        SchemeCheck(bad, background=False).result()
    with pytest.raises(UnsupportedSchemeError) as child:
        SchemeCheck(bad, background=True).result()
    assert str(child.value) == str(inline.value)
    assert child.value.hint == inline.value.hint
    assert expect in str(child.value)


def test_scheme_check_cancel_kills_the_child(ckpt: Path) -> None:
    c = SchemeCheck(ckpt, background=True)
    c.cancel()
    assert not c._proc.is_alive()
    with pytest.raises(Exception, match="cancelled"):
        c.result()


# --- stage failures ----------------------------------------------------------------------


def _plan(ckpt: Path):
    ck = open_checkpoint(ckpt)
    find_layers(ck)
    return make_plan(ck, profile="w8a16", act_dtype="bfloat16", tp=1, fusion="vllm")


def _writers(plan, tmp: Path) -> dict[str, HashingWriter]:
    return {n: HashingWriter(tmp / n, lay) for n, lay in plan.files.items() if n.startswith("rank")}


def test_streamer_transform_error_stops_every_stage(ckpt: Path, tmp_path: Path) -> None:
    plan = _plan(ckpt)
    writers = _writers(plan, tmp_path)
    calls = []

    from mpack.convert.backends.torch import TorchBackend

    backend = TorchBackend(torch.device("cpu"), "ops")

    def boom(layer, src, act):
        calls.append(layer.name)
        if len(calls) == 3:
            raise RuntimeError("transform failed on purpose")
        return backend.transform(layer, src, act)

    before = threading.active_count()
    with pytest.raises(RuntimeError, match="on purpose"):
        Streamer([Sink(plan, writers, backend, transform=boom)]).run()
    backend.close()
    for w in writers.values():
        w.close()
    assert len(calls) == 3
    assert threading.active_count() <= before  # reader and writer threads are gone


def test_streamer_read_error_is_the_one_reported(ckpt: Path, tmp_path: Path) -> None:
    """A shard truncated after planning: the reader's CorruptFileError, not a secondary error."""
    import shutil

    src = tmp_path / "ck"
    shutil.copytree(ckpt, src)
    plan = _plan(src)
    weights = [plan.ckpt.tensors[f"{p.module}.weight"] for u in plan.units for p in u[0].pieces]
    last = max(weights, key=lambda t: t.offset)
    assert last.offset > min(t.offset for t in weights)  # earlier units read fine
    os.truncate(src / last.file, last.offset + 1)  # that weight loses all but one byte
    writers = _writers(plan, tmp_path)
    from mpack.convert.backends.torch import TorchBackend

    backend = TorchBackend(torch.device("cpu"), "ops")
    with pytest.raises(CorruptFileError, match="truncated"):
        Streamer([Sink(plan, writers, backend)]).run()
    backend.close()
    for w in writers.values():
        w.close()


# --- small pieces, tight rings: the same bytes --------------------------------------------


def test_passthrough_copy_through_small_reused_buffers(
    ckpt: Path, tmp_path: Path, monkeypatch
) -> None:
    """Pass-through tensors copied 4 KiB at a time through one reused buffer: the same sidecar
    as with the defaults."""
    from mpack import iokit
    from mpack.convert import pipeline

    a = pipeline.run_convert(ckpt, tmp_path / "a", ConvertOptions(device="cpu"))
    monkeypatch.setattr(iokit, "COPY_BYTES", 4096)
    b = pipeline.run_convert(ckpt, tmp_path / "b", ConvertOptions(device="cpu"))
    assert a.manifest["files"] == b.manifest["files"]


@pytest.mark.gpu
@pytest.mark.parametrize("piece, count", [(4096, 2), (65536, 3)])
def test_gpu_small_pieces_and_tight_rings_give_the_cpu_bytes(
    ckpt: Path, tmp_path: Path, monkeypatch, piece: int, count: int
) -> None:
    """Every layer split over many pinned pieces, rings of 2-3 pieces (every piece reused many
    times, each reuse waiting on a copy event or the hasher), TP 2: the CPU path's bytes."""
    from mpack.convert import pipeline
    from mpack.convert.backends import torch as torch_backend

    a = pipeline.run_convert(ckpt, tmp_path / "cpu", ConvertOptions(device="cpu", tp=2))
    monkeypatch.setattr(torch_backend, "PIECE", piece)
    monkeypatch.setattr(torch_backend, "IN_PIECES", count)
    monkeypatch.setattr(torch_backend, "OUT_PIECES", count)
    opts = ConvertOptions(device="cuda", tp=2, backend="torch")  # the rings are torch's
    b = pipeline.run_convert(ckpt, tmp_path / "gpu", opts)
    assert b.backend["name"] == "torch"
    assert a.manifest["files"] == b.manifest["files"]
    assert b.seconds["read_busy"] > 0 and b.seconds["write_busy"] > 0


@pytest.mark.parametrize("path", ["host", "torch"])
def test_timeline_accounts_for_the_run(ckpt: Path, tmp_path: Path, monkeypatch, path: str) -> None:
    """ConvertResult.timeline: every stage has spans, each inside the run, and the main lane's
    phases follow one another (validate, setup, torch, validate-values, stream, finish, ...,
    swap) without overlap: torch is imported after the work directory is set up (Note [torch
    off the critical path]), and not at all on the host path (Note [host path])."""
    from mpack.convert import pipeline

    r = pipeline.run_convert(ckpt, tmp_path / "out", ConvertOptions(device="cpu", backend=path))
    spans = r.timeline
    lanes = {lane for lane, *_ in spans}
    assert {"main", "read", "transform", "write", "copy", "hash-src"} <= lanes
    assert all(0 <= a <= b <= r.seconds["total"] + 1e-3 for _, _, a, b in spans)
    main = [(what, a, b) for lane, what, a, b in spans if lane == "main"]
    phases = ["validate", "setup", "torch", "validate-values", "stream", "finish"]
    if path == "host":
        phases.remove("torch")
    assert [w for w, _, _ in main][: len(phases)] == phases
    assert main[-1][0] == "swap"
    assert all(b0 <= a1 + 1e-4 for (_, _, b0), (_, a1, _) in zip(main, main[1:], strict=False))
    written = [s for s in spans if s[0] == "write" and not s[1].startswith("wait")]
    assert {what for _, what, _, _ in written} == {"rank-00-of-01.safetensors"}


@pytest.mark.parametrize("n", [0, 1, 999, 1000, 1001, 4567])
def test_copied_file_record_comes_from_one_read(tmp_path: Path, monkeypatch, n: int) -> None:
    """A copied file's record (sha256 and chunk digests, computed while copying) equals the
    digests of the copy, whatever its size against the chunk and copy sizes."""
    from mpack import iokit

    monkeypatch.setattr(iokit, "COPY_BYTES", 300)
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_bytes(random.Random(n).randbytes(n))
    rec = iokit.copy_file(a, b, 1000)
    body = b.read_bytes()
    assert body == a.read_bytes()
    assert rec["name"] == "b.json" and rec["size"] == n
    assert rec["sha256"] == hashlib.sha256(body).hexdigest()
    want = [rec["sha256"]] if n <= 1000 else chunk_digests(b, 1000)
    assert rec["chunks"] == {"bytes": 1000, "sha256": want}
