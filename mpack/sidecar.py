"""The sidecar on disk: file names, the manifest, and 64-byte-aligned safetensors files.

This module owns the sidecar format (docs/FORMAT.md): both ``mpack convert`` (writer) and
``mpack.runtime`` (reader) go through it, and every on-disk name is a constant defined here.

A sidecar is a directory::

    mpack.json                      manifest: format, target, source provenance, file checksums
    rank-{r:02d}-of-{T:02d}.safetensors   Marlin tensors of TP rank r (vLLM's fused names)
    common.safetensors              pass-through tensors (embeddings, norms, lm_head), unchanged
    config.json, generation_config.json, tokenizer files   copied from the source

Each ``.safetensors`` file is a stock safetensors file whose data section starts at a multiple
of 64 (the JSON header is padded with spaces) and whose tensors of a 64-multiple size come
first, so each of those starts 64-byte aligned (Note [alignment]).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import struct
import threading
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from mpack import __version__
from mpack.errors import CorruptFileError, FormatVersionError, InputError, SourceNotFoundError

FORMAT = "mpack-sidecar"
FORMAT_VERSION = 2
#: Versions this mpack reads: 1 listed a whole-file sha256 for every file; 2 may omit it where
#: the file carries chunk digests (Note [chunk digests]).
READABLE_VERSIONS = (1, 2)
MANIFEST_NAME = "mpack.json"
COMMON_NAME = "common.safetensors"
ALIGN = 64
KERNEL = "marlin-fp8"
ENGINE = "vllm"
ENGINE_VERSION = "0.33.0"
PROFILES = ("w8a16", "w8a8-marlin")
FUSIONS = ("vllm", "none")
#: Source files copied into the sidecar verbatim when present.
COPIED_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
)
#: Largest header we accept when reading a safetensors file (the format's own limit is 100 MB).
MAX_HEADER = 100 * 1024 * 1024
HASH_CHUNK = 8 * 1024 * 1024
#: Files also carry the sha256 of every CHUNK_BYTES piece (Note [chunk digests]).
CHUNK_BYTES = 64 * 1024 * 1024

# safetensors dtype names <-> bytes per element
DTYPE_SIZES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip


def torch_dtype(name: str) -> Any:
    """The ``torch.dtype`` of a safetensors dtype name (torch is imported on first use)."""
    return _torch_dtypes()[name]


@functools.cache
def _torch_dtypes() -> dict[str, Any]:
    import torch

    return {
        "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8,
        "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
        "I16": torch.int16, "U16": torch.uint16, "F16": torch.float16, "BF16": torch.bfloat16,
        "I32": torch.int32, "U32": torch.uint32, "F32": torch.float32,
        "I64": torch.int64, "U64": torch.uint64, "F64": torch.float64,
    }  # fmt: skip


def rank_file_name(rank: int, tp: int) -> str:
    """``rank-{r:02d}-of-{T:02d}.safetensors``."""
    return f"rank-{rank:02d}-of-{tp:02d}.safetensors"


def regenerate_hint(source: str | None, out: str | os.PathLike | None) -> str:
    """The command that rebuilds a sidecar (shown when one is unusable)."""
    return f"mpack convert {source or '<source>'} -o {out or '<sidecar>'} --force"


def regenerate_hint_of(manifest: Mapping[str, Any], sidecar: str | os.PathLike) -> str:
    """``regenerate it: <command>`` for a sidecar, its source taken from the manifest."""
    src = manifest.get("source") if isinstance(manifest.get("source"), Mapping) else {}
    return "regenerate it: " + regenerate_hint(src.get("repo") or src.get("path"), sidecar)


# --- hashing ---------------------------------------------------------------------------


class HashCancelled(Exception):
    """A hash stopped early because its ``stop`` event was set (the run it served failed)."""


def sha256_file(
    path: str | os.PathLike, chunk: int = HASH_CHUNK, stop: threading.Event | None = None
) -> str:
    """Hex sha256 of a file, read in large sequential chunks; ``stop`` aborts it between chunks."""
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(chunk)
        view = memoryview(buf)
        while n := f.readinto(buf):
            if stop is not None and stop.is_set():
                raise HashCancelled(str(path))
            h.update(view[:n])
    return h.hexdigest()


def chunk_digests(
    path: str | os.PathLike, chunk: int = CHUNK_BYTES, workers: int | None = None
) -> list[str]:
    """sha256 of every ``chunk``-byte piece of a file (the last may be shorter), in parallel.

    Note [chunk digests]: one sha256 stream runs at ~1.2 GB/s on a server core, slower than an
    NVMe disk, so a loader that checks only the whole-file sha256 is hash-bound, and so is a
    writer that computes one. The manifest therefore lists per-chunk digests, which the writer
    computes and a loader checks on many threads as the bytes stream. Since format version 2 the
    safetensors files carry only these; the small copied files also keep a whole-file sha256.
    """

    size = os.path.getsize(path)
    n = max(1, -(-size // chunk))
    with ThreadPoolExecutor(max_workers=workers or min(16, os.cpu_count() or 1)) as pool:
        return list(
            pool.map(
                lambda i: hash_range(Path(path), i * chunk, min((i + 1) * chunk, size)), range(n)
            )
        )


# --- safetensors layout ------------------------------------------------------------------


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a file to write: safetensors dtype name and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = DTYPE_SIZES[self.dtype]
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class TensorEntry:
    """A tensor inside a safetensors file: absolute byte range ``[offset, offset + nbytes)``."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass
class FileLayout:
    """The complete byte layout of one safetensors file, known before any data is written.

    Note [alignment]: the header is padded with spaces so the data section starts at a multiple
    of ``ALIGN``; tensors whose size is a multiple of ``ALIGN`` are placed first (in the order
    given), the rest after them (in the order given), so safetensors' no-gap rule holds and
    every 64-multiple tensor starts 64-byte aligned.
    """

    header: bytes  # the 8-byte length prefix + JSON header, padded
    entries: list[TensorEntry]  # in file order
    size: int  # total file size in bytes
    metadata: dict[str, str] = field(default_factory=dict)

    @property
    def data_start(self) -> int:
        return len(self.header)

    def entry(self, name: str) -> TensorEntry:
        for e in self.entries:
            if e.name == name:
                return e
        raise KeyError(name)

    @classmethod
    def plan(
        cls, specs: Iterable[TensorSpec], metadata: Mapping[str, str] | None = None
    ) -> FileLayout:
        specs = list(specs)
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError("duplicate tensor names in one file")
        ordered = [s for s in specs if s.nbytes % ALIGN == 0] + [
            s for s in specs if s.nbytes % ALIGN
        ]
        header: dict[str, Any] = {}
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        rel = 0
        for s in ordered:
            header[s.name] = {
                "dtype": s.dtype,
                "shape": list(s.shape),
                "data_offsets": [rel, rel + s.nbytes],
            }
            rel += s.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        pad = (-(8 + len(raw))) % ALIGN
        raw += b" " * pad
        head = struct.pack("<Q", len(raw)) + raw
        start = len(head)
        entries = []
        for s in ordered:
            a, b = header[s.name]["data_offsets"]
            entries.append(TensorEntry(s.name, s.dtype, s.shape, start + a, b - a))
        return cls(header=head, entries=entries, size=start + rel, metadata=dict(metadata or {}))


def read_layout(path: str | os.PathLike) -> FileLayout:
    """Parse and validate a safetensors file's header without reading tensor data.

    Raises:
        CorruptFileError: truncated file, bad header length or JSON, unknown dtype, offsets
            that overlap, leave gaps, or run past the end of the file.
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CorruptFileError(f"{path}: {size} bytes is too short for a safetensors file")
            (hlen,) = struct.unpack("<Q", prefix)
            if hlen > MAX_HEADER or 8 + hlen > size:
                raise CorruptFileError(
                    f"{path}: header length {hlen} does not fit in a file of {size} bytes (truncated?)"
                )
            raw = f.read(hlen)
    except FileNotFoundError:
        raise SourceNotFoundError(f"{path}: no such file") from None
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
    except ValueError as e:
        raise CorruptFileError(f"{path}: malformed safetensors header ({e})") from None
    meta = header.pop("__metadata__", None) or {}
    start = 8 + hlen
    entries: list[TensorEntry] = []
    for name, info in header.items():
        try:
            dtype, shape, (a, b) = (
                info["dtype"],
                tuple(int(d) for d in info["shape"]),
                info["data_offsets"],
            )
            spec = TensorSpec(name, dtype, shape)
            ok = dtype in DTYPE_SIZES and 0 <= a <= b and b - a == spec.nbytes
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise CorruptFileError(f"{path}: tensor {name!r} has a malformed header entry {info!r}")
        entries.append(TensorEntry(name, dtype, shape, start + a, b - a))
    entries.sort(key=lambda e: e.offset)
    pos = start
    for e in entries:
        if e.offset != pos:
            raise CorruptFileError(
                f"{path}: tensor {e.name!r} starts at byte {e.offset}, expected {pos}"
            )
        pos += e.nbytes
    if pos != size:
        what = "truncated" if pos > size else "has trailing bytes"
        raise CorruptFileError(
            f"{path}: file {what}: tensors end at byte {pos}, file has {size} bytes"
        )
    return FileLayout(header=prefix + raw, entries=entries, size=size, metadata=dict(meta))


class HashingWriter:
    """Writes one planned safetensors file front to back, hashing every byte as it goes.

    Writes must come in file order (the planner guarantees it); each tensor's bytes may arrive
    in several chunks, and :meth:`write_at` is done with them when it returns. Two kinds of work
    overlap the caller's next write (both release the GIL):

    - the per-chunk sha256 list (Note [chunk digests]): each ``chunk_bytes`` piece is re-read
      from the page cache and hashed on a shared pool as soon as the writer has passed its end;
    - write-behind (Note [write-behind]): every ``FLUSH_BYTES`` written, the kernel is asked to
      start writing that range to disk, so the final fsync finds little left to do.

    ``finish()`` checks that every planned byte was written, fsyncs, and returns
    ``(size, sha256)``; ``chunks`` then holds the chunk digests (``chunk_bytes=None``: none).
    The whole-file sha256 is computed in :meth:`write_at` itself; ``whole_file=False`` (what
    ``mpack convert`` uses) skips it, and ``finish`` returns None for it: one sha256 stream is
    slower than the disk, and the chunk digests alone cover every byte.
    """

    FLUSH_BYTES = 32 * 1024 * 1024

    def __init__(
        self,
        path: str | os.PathLike,
        layout: FileLayout,
        chunk_bytes: int | None = CHUNK_BYTES,
        whole_file: bool = True,
    ) -> None:
        self.path = Path(path)
        self.layout = layout
        self.chunk_bytes = chunk_bytes
        self.chunks: list[str] = []
        self._f: BinaryIO = open(self.path, "wb", buffering=0)  # noqa: SIM115 - closed in finish()
        self._h = hashlib.sha256() if whole_file else None
        self._pos = 0
        self._flushed = 0
        self._chunk_futs: list[Future[str]] = []
        self._flushes: list[Future[None]] = []
        self._write(layout.header)

    def _write(self, data: Any) -> None:
        mv = memoryview(data).cast("B")
        done = 0
        while done < len(mv):
            done += self._f.write(mv[done:])
        if self._h is not None:
            self._h.update(mv)
        self._pos += len(mv)
        if self._pos - self._flushed >= self.FLUSH_BYTES:
            self._flush_behind()
        if self.chunk_bytes:
            while (len(self._chunk_futs) + 1) * self.chunk_bytes <= self._pos:
                self._submit_chunk(len(self._chunk_futs))

    def _flush_behind(self) -> None:
        start, self._flushed = self._flushed, self._pos
        if _sync_file_range is not None:
            fut = _background().submit(start_writeback, self._f.fileno(), start, self._pos - start)
            self._flushes = [f for f in self._flushes if not f.done()] + [fut]

    def _submit_chunk(self, i: int) -> None:
        assert self.chunk_bytes
        a = i * self.chunk_bytes
        b = min(a + self.chunk_bytes, self._pos)
        self._chunk_futs.append(_background().submit(hash_range, self.path, a, b))

    @property
    def position(self) -> int:
        return self._pos

    def write_at(self, offset: int, data: Any) -> None:
        """Append ``data`` (bytes-like, e.g. a numpy array) at ``offset``, which must be the end.
        ``data`` may be reused as soon as this returns."""
        if offset != self._pos:
            raise AssertionError(
                f"{self.path.name}: write at {offset}, but the file is at {self._pos}"
            )
        self._write(data)

    def fence(self) -> threading.Event:
        """An event set once every buffer passed to :meth:`write_at` so far is no longer read:
        always already set, since :meth:`write_at` hashes and writes before it returns."""
        ev = threading.Event()
        ev.set()
        return ev

    def finish(self) -> tuple[int, str | None]:
        if self._pos != self.layout.size:
            raise AssertionError(f"{self.path.name}: wrote {self._pos} of {self.layout.size} bytes")
        if self.chunk_bytes and (
            not self._chunk_futs or len(self._chunk_futs) * self.chunk_bytes < self._pos
        ):
            self._submit_chunk(len(self._chunk_futs))  # the last, shorter chunk (or an empty file)
        for fut in self._flushes:
            fut.result()
        os.fsync(self._f.fileno())
        self._f.close()
        self.chunks = [f.result() for f in self._chunk_futs]
        return self._pos, self._h.hexdigest() if self._h is not None else None

    def close(self) -> None:
        for fut in self._chunk_futs + self._flushes:
            fut.cancel()
        if not self._f.closed:
            self._f.close()


# Note [write-behind]: Linux starts writing dirty pages back only past dirty_background_ratio
# (10 % of memory by default: ~13 GB on a 128 GB host), so a 9 GB sidecar would sit in the page
# cache until the final fsync and then be flushed in one serial wait as long as the disk write
# itself. sync_file_range(SYNC_FILE_RANGE_WRITE) starts writeback of a range without waiting for
# it, so the disk writes while the pipeline still reads and transforms; fsync at the end waits
# only for the tail. Where the call does not exist (not Linux), writes fall back to plain
# page-cache writes and the final fsync.
def _load_sync_file_range() -> Any:
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _load_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2
_BG: ThreadPoolExecutor | None = None
_BG_LOCK = threading.Lock()


def _background() -> ThreadPoolExecutor:
    """One shared pool for chunk hashing and write-behind requests (many files, one process)."""
    global _BG
    with _BG_LOCK:
        if _BG is None:
            _BG = ThreadPoolExecutor(min(16, os.cpu_count() or 1), thread_name_prefix="mpack-bg")
        return _BG


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing ``[offset, offset + nbytes)`` of ``fd`` to disk, without
    waiting (Note [write-behind]); a no-op where sync_file_range does not exist."""
    if _sync_file_range is not None:
        _sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)  # advisory: errors ignored


def hash_range(path: Path, a: int, b: int) -> str:
    """sha256 of bytes ``[a, b)`` of ``path`` (read back from the page cache)."""
    h = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY)
    try:
        pos = a
        while pos < b:
            data = os.pread(fd, min(HASH_CHUNK, b - pos), pos)
            if not data:
                raise CorruptFileError(f"{path}: file shrank while hashing")
            h.update(data)
            pos += len(data)
    finally:
        os.close(fd)
    return h.hexdigest()


# --- manifest ----------------------------------------------------------------------------


def manifest_bytes(manifest: Mapping[str, Any]) -> bytes:
    """The canonical encoding written to ``mpack.json`` (sorted keys, 2-space indent)."""
    return (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()


def digest_of(manifest: Mapping[str, Any]) -> str:
    """The manifest digest: sha256 of its canonical encoding (names a served sidecar)."""
    return hashlib.sha256(manifest_bytes(manifest)).hexdigest()


def new_manifest(*, target: Mapping[str, Any], source: Mapping[str, Any], model: Mapping[str, Any],
                 layers: Mapping[str, Any], files: list[dict[str, Any]]) -> dict[str, Any]:  # fmt: skip
    """Assemble a manifest (SPEC §9 required keys plus mpack's own)."""
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "created_by": f"mpack {__version__}",
        "target": dict(target),
        "source": dict(source),
        "model": dict(model),
        "layers": dict(layers),
        "files": files,
    }


def target_of(*, profile: str, act_dtype: str, tp: int, fusion: str) -> dict[str, Any]:
    return {
        "kernel": KERNEL,
        "engine": ENGINE,
        "engine_version": ENGINE_VERSION,
        "profile": profile,
        "act_dtype": act_dtype,
        "tp_size": tp,
        "fusion": fusion,
    }


def check_manifest(m: Any, where: str | os.PathLike) -> dict[str, Any]:
    """Validate a parsed manifest's shape and version; return it.

    Raises:
        FormatVersionError: a format version this mpack does not read (with the regenerate command).
        CorruptFileError: not an mpack manifest, or required keys missing/mistyped.
    """
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise CorruptFileError(f"{where}: not an mpack sidecar manifest (format is not {FORMAT!r})")
    if m.get("format_version") not in READABLE_VERSIONS or isinstance(
        m.get("format_version"), bool
    ):
        raise FormatVersionError(
            f"{where}: sidecar format version {m.get('format_version')!r}, this mpack "
            f"({__version__}) reads version{'s' if len(READABLE_VERSIONS) > 1 else ''} "
            f"{', '.join(map(str, READABLE_VERSIONS))}",
            hint=regenerate_hint_of(m, Path(where).parent),
        )
    required = {"target": dict, "source": dict, "files": list, "layers": dict, "model": dict}
    for key, typ in required.items():
        if not isinstance(m.get(key), typ):
            raise CorruptFileError(
                f"{where}: manifest key {key!r} is missing or not a {typ.__name__}"
            )
    t = m["target"]
    for key in ("kernel", "engine", "engine_version", "profile", "act_dtype", "tp_size", "fusion"):
        if key not in t:
            raise CorruptFileError(f"{where}: manifest target lacks {key!r}")
    for f in m["files"]:
        sha_ok = isinstance(f, dict) and (
            isinstance(f.get("sha256"), str)
            or ("sha256" not in f and m["format_version"] >= 2 and "chunks" in f)
        )  # version 2: a file may carry only its chunk digests
        if not (sha_ok and isinstance(f.get("name"), str) and isinstance(f.get("size"), int)):
            raise CorruptFileError(f"{where}: malformed files entry {f!r}")
        ch = f.get("chunks")
        if ch is not None and not (
            isinstance(ch, dict) and isinstance(ch.get("bytes"), int) and ch["bytes"] > 0
            and isinstance(ch.get("sha256"), list) and len(ch["sha256"]) == max(1, -(-f["size"] // ch["bytes"]))
        ):  # fmt: skip
            raise CorruptFileError(f"{where}: malformed chunks of {f['name']!r}")
        if "/" in f["name"] or f["name"] in ("", ".", ".."):
            raise CorruptFileError(f"{where}: file name {f['name']!r} is not a plain file name")
    return m


def load_manifest(sidecar: str | os.PathLike) -> tuple[dict[str, Any], str]:
    """Read and validate ``<sidecar>/mpack.json``; return ``(manifest, digest)``."""
    path = Path(sidecar) / MANIFEST_NAME
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        if not Path(sidecar).exists():
            raise SourceNotFoundError(f"{sidecar}: no such sidecar directory") from None
        raise InputError(
            f"{sidecar}: no {MANIFEST_NAME}: not a finished mpack sidecar",
            hint="create one with: mpack convert <source> -o " + str(sidecar),
        ) from None
    try:
        m = json.loads(raw)
    except ValueError as e:
        raise CorruptFileError(f"{path}: malformed JSON ({e})") from None
    check_manifest(m, path)
    return m, digest_of(m)


def write_manifest(directory: str | os.PathLike, manifest: Mapping[str, Any]) -> str:
    """Write ``mpack.json`` (fsynced) and return its digest."""
    data = manifest_bytes(manifest)
    path = Path(directory) / MANIFEST_NAME
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return hashlib.sha256(data).hexdigest()


def fsync_dir(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def chunk_mismatch(
    got: Sequence[str], want: Sequence[str], chunk_bytes: int, size: int
) -> tuple[int, int, int, int] | None:
    """The first chunk whose digest differs from the manifest's: ``(index, start, end, how many
    chunks differ)``, or None when all agree."""
    bad = [i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b]
    if not bad:
        return None
    lo = bad[0] * chunk_bytes
    return bad[0], lo, min(lo + chunk_bytes, size), len(bad)


def check_files(sidecar: str | os.PathLike, manifest: Mapping[str, Any]) -> list[str]:
    """Re-hash every file listed in the manifest; return one message per problem (empty = ok)."""
    problems = []
    for f in manifest["files"]:
        p = Path(sidecar) / f["name"]
        if not p.is_file():
            problems.append(f"{f['name']}: missing")
            continue
        size = p.stat().st_size
        if size != f["size"]:
            problems.append(f"{f['name']}: size {size}, manifest says {f['size']}")
            continue
        ch = f.get("chunks")
        if ch:  # the chunk digests cover every byte; the loader checks the same
            got = chunk_digests(p, ch["bytes"])
            bad = chunk_mismatch(got, ch["sha256"], ch["bytes"], size)
            if bad:
                i, lo, hi, nbad = bad
                problems.append(
                    f"{f['name']}: sha256 of bytes {lo}..{hi} is {got[i][:16]}..., "
                    f"manifest says {ch['sha256'][i][:16]}... ({nbad} of {len(got)} chunks differ)"
                )
        else:
            digest = sha256_file(p)
            if digest != f["sha256"]:
                problems.append(
                    f"{f['name']}: sha256 {digest[:16]}..., manifest says {f['sha256'][:16]}..."
                )
    return problems
