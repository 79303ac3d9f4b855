"""O_DIRECT writes of the sidecar (Note [direct writes] in mpack/iokit.py): the same bytes and
chunk digests as the page-cache writer, for any size and any way the bytes arrive; the fallbacks
where a file system refuses O_DIRECT at open or at a write; errors that name the file.

Real files on the test's own disk; the refusals are made by wrapping ``os.open`` and
``os.pwrite`` the way such a file system answers (EINVAL).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import random
from pathlib import Path
from typing import Any

import pytest

from mpack.fixtures import make_checkpoint
from mpack.iokit import DirectWriter, chunk_digests
from mpack.sidecar import DirectHashingWriter, FileMap, HashingWriter, TensorSpec, open_writer

CHUNK = 8192  # two blocks: many chunks, first and last partial, in a small file


def _direct_here(tmp_path: Path) -> None:
    """Skip where this file system refuses O_DIRECT (the fallback tests below cover it)."""
    try:
        DirectWriter(tmp_path / "probe", 0, CHUNK).finish()
    except OSError as e:
        if e.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            pytest.skip(f"{tmp_path} refuses O_DIRECT")
        raise


def _fill(w: DirectWriter, data: bytes, rng: random.Random, in_place: bool) -> None:
    """Feed ``data`` to ``w`` in random pieces: copied in, or read into :meth:`space`."""
    pos = 0
    while pos < len(data):
        if in_place:
            room = w.space()
            n = min(len(room), rng.randint(1, 3 * CHUNK), len(data) - pos)
            room[:n] = data[pos : pos + n]
            w.advance(n)
        else:
            n = min(rng.randint(1, 3 * CHUNK), len(data) - pos)
            w.write_at(pos, data[pos : pos + n])
        pos += n


@pytest.mark.parametrize("in_place", [False, True], ids=["write_at", "space"])
@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 4097, CHUNK, CHUNK + 1, 7 * CHUNK - 5])
def test_bytes_and_chunk_digests_match_the_file(tmp_path: Path, size: int, in_place: bool) -> None:
    _direct_here(tmp_path)
    data = random.Random(size).randbytes(size)
    path = tmp_path / "f"
    w = DirectWriter(path, size, CHUNK)
    assert fcntl.fcntl(w._fd, fcntl.F_GETFL) & os.O_DIRECT, "not an O_DIRECT file"
    _fill(w, data, random.Random(size + 1), in_place)
    assert w.finish() == (size, None)
    assert path.read_bytes() == data  # the last block's padding truncated away
    assert w.chunks == chunk_digests(path, CHUNK)
    assert len(w.chunks) == max(1, -(-size // CHUNK))


def test_a_piece_is_not_refilled_before_its_hash_and_write(tmp_path: Path) -> None:
    """Two staging pieces, many chunks, each chunk a different byte: a piece reused too early
    would put the next chunk's bytes into an earlier chunk's digest or write."""
    _direct_here(tmp_path)
    count = 64
    path = tmp_path / "f"
    w = DirectWriter(path, count * CHUNK, CHUNK, depth=2)
    for i in range(count):
        w.write_at(i * CHUNK, bytes([i]) * CHUNK)
    w.finish()
    assert w.chunks == [hashlib.sha256(bytes([i]) * CHUNK).hexdigest() for i in range(count)]
    assert path.read_bytes() == b"".join(bytes([i]) * CHUNK for i in range(count))


def test_the_writer_refuses_out_of_order_overlong_and_short_files(tmp_path: Path) -> None:
    _direct_here(tmp_path)
    w = DirectWriter(tmp_path / "f", 100, CHUNK)
    with pytest.raises(AssertionError, match="write at"):
        w.write_at(1, b"x")
    with pytest.raises(AssertionError, match="past its 100 bytes"):
        w.write_at(0, b"x" * 101)
    w.close()
    w = DirectWriter(tmp_path / "g", 100, CHUNK)
    w.write_at(0, b"x" * 50)
    with pytest.raises(AssertionError, match="wrote 50 of 100"):
        w.finish()
    w.close()


def _file_map(nbytes: int) -> FileMap:
    return FileMap.plan([TensorSpec("t", "U8", (nbytes,))], {})


def test_open_writer_falls_back_where_open_refuses_o_direct(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """EINVAL from an O_DIRECT open (as tmpfs on older kernels answers): the page-cache writer,
    the same bytes and digests."""
    real_open = os.open

    def refusing(path: str, flags: int, *a: object) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a)

    file_map = _file_map(3 * 1024 * 1024)
    data = random.Random(3).randbytes(file_map.entry("t").nbytes)
    monkeypatch.setattr(os, "open", refusing)
    w = open_writer(tmp_path / "f", file_map, direct=True)
    monkeypatch.undo()
    assert type(w) is HashingWriter
    w.write_at(file_map.entry("t").offset, data)
    w.finish()
    assert (tmp_path / "f").read_bytes()[file_map.entry("t").offset :] == data
    assert w.chunks == chunk_digests(tmp_path / "f", w.chunk_bytes)


def test_open_writer_takes_o_direct_where_it_can(tmp_path: Path) -> None:
    _direct_here(tmp_path)
    file_map = _file_map(10)
    assert type(open_writer(tmp_path / "a", file_map, direct=True)) is DirectHashingWriter
    assert type(open_writer(tmp_path / "b", file_map, direct=False)) is HashingWriter


def test_a_write_o_direct_refuses_is_redone_through_the_page_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file system that took O_DIRECT at open but refuses the write (EINVAL): the flag goes,
    the write is redone, the bytes are right."""
    _direct_here(tmp_path)
    real_pwrite = os.pwrite
    refused = []

    def refusing(fd: int, data: object, offset: int) -> int:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", refusing)
    size = 5 * CHUNK + 123
    data = random.Random(5).randbytes(size)
    path = tmp_path / "f"
    w = DirectWriter(path, size, CHUNK, depth=1)
    w.write_at(0, data)
    w.finish()
    assert refused == [0], "the first write was refused once; later ones went plain"
    assert path.read_bytes() == data
    assert w.chunks == chunk_digests(path, CHUNK)


def test_a_failed_write_names_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ENOSPC from a write on the pool: ``finish`` raises it with the file's name (the CLI's
    disk-full message names the file from it)."""
    _direct_here(tmp_path)

    def full(fd: int, data: object, offset: int) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    path = tmp_path / "f"
    w = DirectWriter(path, 3 * CHUNK, CHUNK)
    with pytest.raises(OSError) as e:  # from the piece reused, or from finish
        w.write_at(0, b"y" * (3 * CHUNK))
        w.finish()
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(path)
    w.close()
    assert w._fd == -1


def _spy_writers(monkeypatch: pytest.MonkeyPatch, pipeline: Any) -> list[dict[str, str]]:
    """Each ``_open_writers`` call of the run, as ``{file: writer class name}``."""
    kinds: list[dict[str, str]] = []
    real = pipeline._open_writers

    def spy(*a: object, **k: object) -> dict:
        got = real(*a, **k)
        kinds.append({n: type(w).__name__ for n, w in got.items()})
        return got

    monkeypatch.setattr(pipeline, "_open_writers", spy)
    return kinds


def test_convert_writes_o_direct_on_few_cores_and_the_same_bytes_otherwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On fewer than DIRECT_BELOW_CORES cores the pass-through and rank files go through
    DirectHashingWriter; with ``direct-write`` turned off, or on more cores, through the page
    cache: byte-identical sidecars."""
    pytest.importorskip("torch")
    pytest.importorskip("compressed_tensors")
    _direct_here(tmp_path)
    import mpack.convert.pipeline as pipeline
    from mpack.convert.options import ConvertOptions

    src = tmp_path / "ck"
    make_checkpoint(src, layers=3)
    kinds = _spy_writers(monkeypatch, pipeline)
    runs = (
        ("direct", 2, frozenset()),
        ("off", 2, frozenset({"direct-write"})),
        ("many-cores", pipeline.DIRECT_BELOW_CORES, frozenset()),
    )
    for name, cores, off in runs:
        monkeypatch.setattr(pipeline, "usable_cores", lambda n=cores: n)
        pipeline.run_convert(src, tmp_path / name, ConvertOptions(device="cpu", disable=off))
    direct = {"common.safetensors": "DirectHashingWriter"}
    direct["rank-00-of-01.safetensors"] = "DirectHashingWriter"
    plain = {"common.safetensors": "HashingWriter", "rank-00-of-01.safetensors": "HashingWriter"}
    assert kinds == [direct, plain, plain]
    for f in sorted(p.name for p in (tmp_path / "off").iterdir()):
        want = (tmp_path / "off" / f).read_bytes()
        assert (tmp_path / "direct" / f).read_bytes() == want, f
        assert (tmp_path / "many-cores" / f).read_bytes() == want, f


def test_only_direct_files_go_o_direct(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tensor-parallel plan: the pass-through file and the first rank file O_DIRECT (two
    chunks of staging memory each), the other rank files through the page cache."""
    pytest.importorskip("torch")
    pytest.importorskip("compressed_tensors")
    _direct_here(tmp_path)
    import contextlib

    import mpack.convert.pipeline as pipeline
    from mpack.convert.checkpoint import open_checkpoint
    from mpack.convert.options import ConvertOptions
    from mpack.convert.plan import make_plan

    monkeypatch.setattr(pipeline, "usable_cores", lambda: 2)

    src = tmp_path / "ck"
    make_checkpoint(src, layers=2)
    plan = make_plan(
        open_checkpoint(src), profile="w8a16", act_dtype="bfloat16", tp=4, fusion="vllm"
    )
    work = tmp_path / "w"
    work.mkdir()
    with contextlib.ExitStack() as stack:
        direct = pipeline.direct_files([plan], ConvertOptions(disable=frozenset()))
        assert direct == {0: ["common.safetensors", "rank-00-of-04.safetensors"]}
        got = pipeline._open_writers(plan, work, stack, direct[0])
        kinds = {n: type(w).__name__ for n, w in got.items()}
    assert list(got) == list(plan.files)
    assert sum(k == "DirectHashingWriter" for k in kinds.values()) == pipeline.DIRECT_FILES == 2
    assert kinds["common.safetensors"] == "DirectHashingWriter"
    assert kinds["rank-00-of-04.safetensors"] == "DirectHashingWriter"
    assert kinds["rank-03-of-04.safetensors"] == "HashingWriter"


def test_one_writer_policy_for_any_number_of_targets(tmp_path: Path, monkeypatch) -> None:
    """The policy (Note [direct writes]) is one function of the run's plans: on few cores the
    first target's pass-through file and first rank file, whatever the number of targets; none
    on many cores or with ``direct-write`` off. A run of several targets writes them O_DIRECT
    too, and its sidecars are still byte for byte the single runs'."""
    pytest.importorskip("torch")
    pytest.importorskip("compressed_tensors")
    _direct_here(tmp_path)
    import mpack.convert.pipeline as pipeline
    from mpack.convert.options import ConvertOptions

    src = tmp_path / "ck"
    make_checkpoint(src, layers=2)
    kinds = _spy_writers(monkeypatch, pipeline)
    monkeypatch.setattr(pipeline, "usable_cores", lambda: 2)
    opts = ConvertOptions(tp=[1, 2], device="cpu", disable=frozenset())
    pipeline.run_convert(src, tmp_path / "many", opts)
    assert [sorted(n for n, k in ks.items() if k == "DirectHashingWriter") for ks in kinds] == [
        ["common.safetensors", "rank-00-of-01.safetensors"],
        [],
    ]
    for tp in (1, 2):
        one = tmp_path / f"one-{tp}"
        pipeline.run_convert(src, one, ConvertOptions(tp=tp, device="cpu", disable=frozenset()))
        many = tmp_path / "many" / f"tp{tp}-w8a16-bfloat16"
        for f in sorted(p.name for p in one.iterdir()):
            assert (many / f).read_bytes() == (one / f).read_bytes(), f
    monkeypatch.setattr(pipeline, "usable_cores", lambda: pipeline.DIRECT_BELOW_CORES)
    assert pipeline.direct_files([], opts) == {}
