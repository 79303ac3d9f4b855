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

import codecs
import errno
import functools
import hashlib
import json
import os
import re
import stat
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from mpack import __version__, target
from mpack.errors import (
    CorruptFileError,
    FormatVersionError,
    InputError,
    SourceNotFoundError,
    quote,
    shown,
)
from mpack.fsutil import (
    kind_of,
    open_regular,
    open_regular_file,
    os_error,
    parse_json,
    read_capped,
)
from mpack.iokit import DirectWriter, FileWriter, fd_chunk_digests, hash_fd_range

FORMAT = "mpack-sidecar"
FORMAT_VERSION = 2
#: Versions this mpack reads: 1 listed a whole-file sha256 for every file; 2 may omit it where
#: the file carries chunk digests (Note [chunk digests]).
READABLE_VERSIONS = (1, 2)
MANIFEST_NAME = "mpack.json"
COMMON_NAME = "common.safetensors"
ALIGN = 64
#: The model's config, copied from the source; loaders build the model from it.
CONFIG_NAME = "config.json"
GENERATION_CONFIG_NAME = "generation_config.json"
#: A Hugging Face checkpoint's weights: one file, or shards listed by an index.
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
#: A checkpoint's licence files, copied so that a pushed sidecar carries its source's terms
#: (Apache-2.0 asks for NOTICE to travel too; Llama's licence names its USE_POLICY.md).
LICENSE_FILES = (
    "LICENSE",
    "LICENSE.md",
    "LICENSE.txt",
    "LICENCE",
    "LICENCE.md",
    "LICENCE.txt",
    "NOTICE",
    "NOTICE.md",
    "NOTICE.txt",
    "USE_POLICY.md",
)
#: Source files copied into the sidecar verbatim when present: the one table of them. vLLM
#: reads the config, generation and tokenizer files (``tekken.json``: Mistral's tokenizer,
#: ``added_tokens.json`` and ``chat_template.json``: older transformers' saves) from the
#: model's directory; ``recipe.yaml`` is llm-compressor's record of how the source was
#: quantized; the licence files go wherever the weights go.
COPIED_FILES = (
    CONFIG_NAME,
    GENERATION_CONFIG_NAME,
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tekken.json",
    "chat_template.jinja",
    "chat_template.json",
    "recipe.yaml",
    *LICENSE_FILES,
)
#: The source's model card: read (its ``license`` metadata, :data:`SOURCE_CARD_KEYS`) and
#: recorded among the source files, never copied (a pushed repo's README.md is mpack's card).
SOURCE_CARD_NAME = "README.md"
#: Optional ``source`` keys the card of a pushed sidecar is made from (docs/FORMAT.md):
#: ``base_model``, the Hub repo a local source is a snapshot of (an HF-cache directory), and the
#: source card's ``license``, ``license_name`` and ``license_link``.
SOURCE_CARD_KEYS = ("base_model", "license", "license_name", "license_link")
#: Largest header length (the 8-byte N) a safetensors file may announce: the format's own
#: limit, 100 MB, which the safetensors library enforces too (a longer one it refuses to load).
MAX_HEADER = 100_000_000
#: Largest ``mpack.json`` we read. A 1 TB model's manifest (chunk digests included) is ~2 MB;
#: the cap keeps a hostile manifest from costing every attaching process gigabytes.
MAX_MANIFEST = 32 * 1024 * 1024
#: Bounds on the numbers a manifest may hold, checked before anything acts on them.
MAX_TP = 1024
MAX_FILE_BYTES = 1 << 48
MAX_DIM = 1 << 24
#: The most experts one MoE block's layer may have (DeepSeek-V3 has 256).
MAX_EXPERTS = 1 << 16
#: The model dimensions a manifest's ``model.config`` records; a loader compares them with the
#: model it loads into (runtime/vllm/checks.py).
MODEL_DIMS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
)
#: Every key ``model.config`` takes from the checkpoint's (text) config, besides ``dtype``.
MODEL_CONFIG_KEYS = ("model_type", *MODEL_DIMS, "head_dim", "tie_word_embeddings")
#: Files also carry the sha256 of every CHUNK_BYTES piece (Note [chunk digests]).
CHUNK_BYTES = 64 * 1024 * 1024

# safetensors dtype names <-> bytes per element
DTYPE_SIZES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}


def torch_dtype(name: str) -> Any:
    """The ``torch.dtype`` of a safetensors dtype name (torch is imported on first use)."""
    return _torch_dtypes()[name]


@functools.cache
def _torch_dtypes() -> dict[str, Any]:
    import torch

    return {
        "BOOL": torch.bool,
        "U8": torch.uint8,
        "I8": torch.int8,
        "F8_E4M3": torch.float8_e4m3fn,
        "F8_E5M2": torch.float8_e5m2,
        "I16": torch.int16,
        "U16": torch.uint16,
        "F16": torch.float16,
        "BF16": torch.bfloat16,
        "I32": torch.int32,
        "U32": torch.uint32,
        "F32": torch.float32,
        "I64": torch.int64,
        "U64": torch.uint64,
        "F64": torch.float64,
    }


def rank_file_name(rank: int, tp: int) -> str:
    """``rank-{r:02d}-of-{T:02d}.safetensors``."""
    return f"rank-{rank:02d}-of-{tp:02d}.safetensors"


def safetensors_files(manifest: Mapping[str, Any]) -> list[str]:
    """The safetensors files of a sidecar, in order: every rank file (all are listed:
    :func:`check_manifest`), then ``common.safetensors`` when the manifest lists it."""
    tp = manifest["target"]["tp_size"]
    listed = {f["name"] for f in manifest["files"]}
    ranks = [rank_file_name(r, tp) for r in range(tp)]
    return ranks + [COMMON_NAME] if COMMON_NAME in listed else ranks


def regenerate_hint(source: str | None, out: str | os.PathLike | None) -> str:
    """The command that rebuilds a sidecar (shown when one is unusable)."""
    return f"mpack convert {source or '<source>'} -o {out or '<sidecar>'} --force"


def regenerate_hint_of(manifest: Mapping[str, Any], sidecar: str | os.PathLike) -> str:
    """``regenerate it: <command>`` for a sidecar, its source taken from the manifest."""
    src = manifest.get("source") if isinstance(manifest.get("source"), Mapping) else {}
    origin = src.get("repo") or src.get("path")  # the manifest's: escaped, as every message quotes
    return "regenerate it: " + regenerate_hint(shown(origin, 4096) if origin else None, sidecar)


# --- the hidden names of a run writing a sidecar ---------------------------------------------

# Note [run names]: a conversion writing the sidecar OUT makes its hidden names beside OUT, in
# OUT's parent, each tagged with OUT's run key (:func:`run_key`: 12 hex digits of the sha256 of
# OUT's name, so that every such name has a fixed length and belongs to one OUT): its lock file
# ``.mpack-<key>.lock`` and its work and old-sidecar directories ``.mpack-<key>.tmp-<8 hex>`` and
# ``.mpack-<key>.old-<8 hex>`` (older mpacks named those ``.<OUT>.mpack-tmp-<pid>-<8 hex>``). What
# they do is the convert's (Note [output lock] in convert/output/lock.py); ``mpack push`` reads
# them too: a directory of sidecars holding one is being written, or was left by a run that did
# not finish (docs/HUB.md).
RUN_LOCK, RUN_WORK, RUN_OLD = "lock", "tmp", "old"
_RUN_NAME = re.compile(r"\.mpack-([0-9a-f]{12})\.(?:(lock)|(tmp|old)-[0-9a-f]{8})")
_OLDER_RUN_NAME = re.compile(r"\.(.+)\.mpack-(tmp|old)-\d+-[0-9a-f]{8}")


def run_key(out_name: str) -> str:
    """The run key of a sidecar named ``out_name`` (Note [run names])."""
    return hashlib.sha256(os.fsencode(out_name)).hexdigest()[:12]


def run_name(out_name: str, kind: str, tag: str = "") -> str:
    """The hidden name of ``kind`` (``RUN_LOCK``, ``RUN_WORK``, ``RUN_OLD``; ``tag``: 8 hex
    digits, for a directory) of a run writing the sidecar ``out_name`` (Note [run names])."""
    key = run_key(out_name)
    return f".mpack-{key}.{RUN_LOCK}" if kind == RUN_LOCK else f".mpack-{key}.{kind}-{tag}"


def parse_run_name(name: str) -> tuple[str, str] | None:
    """``(run key, kind)`` of a run's hidden name, new or old naming (Note [run names]); None
    for any other name."""
    m = _RUN_NAME.fullmatch(name)
    if m:
        return m[1], m[2] or m[3]
    m = _OLDER_RUN_NAME.fullmatch(name)
    return (run_key(m[1]), m[2]) if m else None


# --- safetensors file maps ------------------------------------------------------------------


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


# Note [alignment]: the header is padded with spaces so the data section starts at a multiple
# of ``ALIGN``; tensors whose size is a multiple of ``ALIGN`` are placed first (in the order
# given), the rest after them (in the order given), so safetensors' no-gap rule holds and
# every 64-multiple tensor starts 64-byte aligned.
@dataclass
class FileMap:
    """The map of one safetensors file: its header bytes and where each tensor lies, known
    before any data is written (Note [alignment]). ("Layout" in mpack means the Marlin layout
    only: docs/LAYOUT.md.)"""

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
    ) -> FileMap:
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


def read_file_map(path: str | os.PathLike, *, follow: bool = True) -> FileMap:
    """Parse and validate a safetensors file's header without reading tensor data.

    ``follow=False`` refuses a symlink (a sidecar's own files); either way the file must be a
    regular file (Note [trust model for files] in mpack/fsutil.py).

    Raises:
        CorruptFileError: truncated file, bad header length or JSON, unknown dtype, a shape or
            offset that is not a non-negative integer, offsets that overlap, leave gaps, or run
            past the end of the file.
        InputError: not a regular file (or a symlink with ``follow=False``).
    """
    path = Path(path)
    size, prefix, raw = read_header_bytes(path, follow=follow)
    header = _parse_header(raw, path)
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict):
        raise CorruptFileError(f"{path}: __metadata__ is not a JSON object")
    start = 8 + len(raw)
    entries = sorted(
        (_header_entry(name, info, start, path) for name, info in header.items()),
        key=lambda e: e.offset,
    )
    pos = start
    for e in entries:
        if e.offset != pos:
            raise CorruptFileError(
                f"{path}: tensor {quote(e.name)} starts at byte {e.offset}, expected {pos}"
            )
        pos += e.nbytes
    if pos != size:
        what = "truncated" if pos > size else "has trailing bytes"
        raise CorruptFileError(
            f"{path}: file {what}: tensors end at byte {pos}, file has {size} bytes"
        )
    return FileMap(header=prefix + raw, entries=entries, size=size, metadata=dict(meta))


def read_header_bytes(path: str | os.PathLike, *, follow: bool = True) -> tuple[int, bytes, bytes]:
    """A safetensors file's size, 8-byte length prefix and JSON header bytes, unparsed (what
    :func:`read_file_map` parses; ``follow`` as there). Raises as :func:`read_file_map` does for a
    file that is not regular or whose header length does not fit."""
    path = Path(path)
    with open_regular_file(path, follow=follow, what="safetensors file") as f:
        size = os.fstat(f.fileno()).st_size
        return (size, *_read_header(f, path, size))


def _read_header(f: BinaryIO, path: Path, size: int) -> tuple[bytes, bytes]:
    """The 8-byte length prefix and the JSON header bytes, bounded by the file and MAX_HEADER."""
    prefix = f.read(8)
    if len(prefix) < 8:
        raise CorruptFileError(f"{path}: {size} bytes is too short for a safetensors file")
    (hlen,) = struct.unpack("<Q", prefix)
    if hlen > MAX_HEADER:
        raise CorruptFileError(
            f"{path}: header length {hlen} is over the {MAX_HEADER} bytes a safetensors header "
            "may have (docs/FORMAT.md; the safetensors library refuses it too)",
            hint="not a safetensors file mpack or vLLM can load; regenerate it",
        )
    if 8 + hlen > size:
        raise CorruptFileError(
            f"{path}: header length {hlen} does not fit in a file of {size} bytes "
            "(truncated, or not a safetensors file)"
        )
    return prefix, f.read(hlen)


def _parse_header(raw: bytes, path: Path) -> dict[str, Any]:
    header = parse_json(raw, path, "safetensors header")
    if not isinstance(header, dict):
        raise CorruptFileError(
            f"{path}: malformed safetensors header (the header is not a JSON object)"
        )
    return header


def _header_entry(name: str, info: Any, start: int, path: Path) -> TensorEntry:
    """One tensor's header entry, checked: a known dtype, counts for dims and offsets, and a
    byte range as long as the shape says."""
    try:
        dtype, shape, (a, b) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        ok = (
            dtype in DTYPE_SIZES
            and all(_is_count(d) for d in shape)
            and _is_count(a)
            and _is_count(b)
            and a <= b
            and b - a == TensorSpec(name, dtype, shape).nbytes
        )
    except (KeyError, TypeError, ValueError):
        ok = False
    if not ok:
        raise CorruptFileError(
            f"{path}: tensor {quote(name)} has a malformed header entry {quote(info)}"
        )
    return TensorEntry(name, dtype, shape, start + a, b - a)


def _is_count(x: Any) -> bool:
    """A non-negative JSON integer (not a bool, not a float such as 2.0)."""
    return type(x) is int and x >= 0


class HashingWriter(FileWriter):
    """Writes one planned safetensors file front to back, its header first, hashing every byte:
    :class:`mpack.iokit.FileWriter` (chunk digests and write-behind behind the writes) with the
    file's :class:`FileMap`.

    Writes must come in file order (the planner guarantees it). ``finish()`` returns
    ``(size, sha256)`` (``whole_file=False``, what ``mpack convert`` uses: None for the sha256)
    and leaves the ``chunk_bytes`` digests in ``chunks`` (Note [chunk digests] in
    mpack/iokit.py).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        file_map: FileMap,
        chunk_bytes: int | None = CHUNK_BYTES,
        whole_file: bool = True,
    ) -> None:
        super().__init__(path, file_map.size, chunk_bytes, whole_file)
        self.file_map = file_map
        self.write_at(0, file_map.header)


class DirectHashingWriter(DirectWriter):
    """:class:`HashingWriter` through O_DIRECT (:class:`mpack.iokit.DirectWriter`, Note [direct
    writes] in mpack/iokit.py): the header first, then the tensors' bytes, read into place
    (:func:`mpack.iokit.copy_tensors`) or copied in (:meth:`write_at`). Chunk digests only."""

    def __init__(
        self, path: str | os.PathLike, file_map: FileMap, chunk_bytes: int = CHUNK_BYTES
    ) -> None:
        super().__init__(path, file_map.size, chunk_bytes)
        self.file_map = file_map
        try:
            self.write_at(0, file_map.header)
        except BaseException:
            self.close()
            raise


def open_writer(
    path: str | os.PathLike, file_map: FileMap, *, direct: bool = True
) -> HashingWriter | DirectHashingWriter:
    """The writer of a planned file (chunk digests only): a :class:`DirectHashingWriter` where
    ``direct`` and the file system takes O_DIRECT, else a :class:`HashingWriter`."""
    if direct and hasattr(os, "O_DIRECT"):
        try:
            return DirectHashingWriter(path, file_map)
        except OSError as e:
            if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                raise
    return HashingWriter(path, file_map, whole_file=False)


# --- manifest ----------------------------------------------------------------------------


def manifest_bytes(manifest: Mapping[str, Any]) -> bytes:
    """The canonical encoding written to ``mpack.json`` (sorted keys, 2-space indent)."""
    return (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()


# Note [manifest digest]: a sidecar's digest (which names a served sidecar) is the sha256 of
# its ``mpack.json`` bytes as read (:func:`load_manifest`). mpack writes the canonical encoding
# (:func:`manifest_bytes`), so for every sidecar it wrote this is also the sha256 of the
# re-encoded manifest; reading it from the bytes spares every attaching process a re-encoding
# with Python's slow indenting JSON encoder (the larger part of an attach's CPU time on the host
# backend). A hand-edited, non-canonical ``mpack.json`` has the digest of its own bytes.
def digest_of(manifest: Mapping[str, Any]) -> str:
    """The digest of ``manifest`` once written: sha256 of its canonical encoding (for a sidecar
    mpack wrote, the sha256 of its ``mpack.json`` bytes: Note [manifest digest])."""
    return hashlib.sha256(manifest_bytes(manifest)).hexdigest()


def new_manifest(
    *,
    target: Mapping[str, Any],
    source: Mapping[str, Any],
    model: Mapping[str, Any],
    layers: Mapping[str, Any],
    files: list[dict[str, Any]],
) -> dict[str, Any]:
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


def target_of(
    *, profile: str, act_dtype: str, tp: int, fusion: str, ep: bool = False
) -> dict[str, Any]:
    return {
        "kernel": target.KERNEL,
        "engine": target.ENGINE,
        "engine_version": target.ENGINE_VERSION,
        "profile": profile,
        "act_dtype": act_dtype,
        "tp_size": tp,
        "fusion": fusion,
        **({target.EXPERT_PARALLEL: True} if ep else {}),
    }


def check_manifest(m: Any, where: str | os.PathLike) -> dict[str, Any]:
    """Validate a parsed manifest's shape, version and every number in it; return it.

    Everything a reader acts on is bounded here, before anything acts on it: the TP size, file
    sizes, chunk sizes and layer dims are integers in range, the target's enums are known, file
    names are plain names listed once, and every rank file the TP size implies is listed
    (Note [trust model for files] in mpack/fsutil.py); a whole-file sha256 agrees with the chunk
    digest of a one-chunk file (Note [both digests]); ``source`` holds strings, a Hub repo id
    and commit, and file entries with one form of digest each.

    Raises:
        FormatVersionError: a format version this mpack does not read (with the regenerate command).
        CorruptFileError: not an mpack manifest, or a key missing, mistyped or out of range.
    """
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise CorruptFileError(f"{where}: not an mpack sidecar manifest (format is not {FORMAT!r})")
    if m.get("format_version") not in READABLE_VERSIONS or isinstance(
        m.get("format_version"), bool
    ):
        raise FormatVersionError(
            f"{where}: sidecar format version {quote(m.get('format_version'), 40)}, this mpack "
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
    _check_target(m["target"], where)
    _check_source(m["source"], where)
    names: set[str] = set()
    for f in m["files"]:
        _check_file_entry(f, m["format_version"], where)
        if f["name"] in names:
            raise CorruptFileError(f"{where}: file {quote(f['name'])} is listed twice")
        names.add(f["name"])
    tp = m["target"]["tp_size"]
    missing = [rank_file_name(r, tp) for r in range(tp) if rank_file_name(r, tp) not in names]
    if missing:
        raise CorruptFileError(
            f"{where}: tp_size is {tp} but the manifest's files do not list "
            f"{', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}"
        )
    if not m["layers"]:  # convert refuses a checkpoint without FP8 layers; so does a reader
        raise CorruptFileError(
            f"{where}: the manifest lists no layers (a sidecar holds at least one Marlin layer)",
            hint="convert the checkpoint again: mpack convert SRC -o OUT --force",
        )
    for name, ly in m["layers"].items():
        ok = isinstance(ly, dict) and type(ly.get("bias")) is bool
        ok = ok and all(type(ly.get(k)) is int and 1 <= ly[k] <= MAX_DIM for k in LAYER_DIMS)
        experts = ly.get("experts") if isinstance(ly, dict) else None
        ok = ok and (experts is None or (type(experts) is int and 1 <= experts <= MAX_EXPERTS))
        if not ok:
            raise CorruptFileError(
                f"{where}: layer {quote(name)} is malformed (needs integer "
                f"{', '.join(LAYER_DIMS)} in 1..{MAX_DIM}, a boolean bias and, for a MoE "
                f"block's experts, an integer experts in 1..{MAX_EXPERTS}): {quote(ly)}"
            )
    return m


#: The layer dims a manifest's ``layers`` entries carry (docs/FORMAT.md).
LAYER_DIMS = ("n", "k", "np", "kp")


def _check_target(t: dict[str, Any], where: str | os.PathLike) -> None:
    for key in ("kernel", "engine", "engine_version", "profile", "act_dtype", "tp_size", "fusion"):
        if key not in t:
            raise CorruptFileError(f"{where}: manifest target lacks {key!r}")
    tp = t["tp_size"]
    if type(tp) is not int or not 1 <= tp <= MAX_TP:
        raise CorruptFileError(
            f"{where}: target tp_size is {quote(tp, 40)}, not an integer in 1..{MAX_TP}"
        )
    allowed = {
        "kernel": (target.KERNEL,),
        "profile": target.PROFILES,
        "act_dtype": tuple(target.ACT_DTYPES),
        "fusion": target.FUSIONS,
    }
    for key, values in allowed.items():
        if t[key] not in values:
            raise CorruptFileError(
                f"{where}: target {key} is {quote(t[key], 40)}, not one of {', '.join(values)}"
            )
    for key in ("engine", "engine_version"):
        if not isinstance(t[key], str):
            raise CorruptFileError(f"{where}: target {key} is not a string")
    ep = t.get(target.EXPERT_PARALLEL)
    if target.EXPERT_PARALLEL in t and (ep is not True or tp < 2):
        raise CorruptFileError(
            f"{where}: target {target.EXPERT_PARALLEL} is {quote(ep, 40)} at tp_size {tp} "
            "(written only as true, at tp_size 2 or more)"
        )


def _is_digest(x: Any) -> bool:
    return isinstance(x, str) and len(x) == 64 and all(c in "0123456789abcdef" for c in x)


def _check_file_entry(f: Any, version: int, where: str | os.PathLike) -> None:
    sha_ok = isinstance(f, dict) and (
        _is_digest(f.get("sha256")) or ("sha256" not in f and version >= 2 and "chunks" in f)
    )  # version 2: a file may carry only its chunk digests
    size = f.get("size") if isinstance(f, dict) else None
    if not (
        sha_ok
        and isinstance(f.get("name"), str)
        and type(size) is int
        and 0 <= size <= MAX_FILE_BYTES
    ):
        raise CorruptFileError(f"{where}: malformed files entry {quote(f)}")
    name = f["name"]
    if not _is_plain_name(name) or name == MANIFEST_NAME:
        raise CorruptFileError(
            f"{where}: file name {quote(name, 80)} is not a plain file name",
            hint="a sidecar's files are named as FORMAT.md says: printable, no '/', not . or ..",
        )
    ch = f.get("chunks")
    if ch is not None and not _chunks_ok(ch, size):
        raise CorruptFileError(f"{where}: malformed chunks of {quote(name, 80)}")
    if ch is not None and "sha256" in f and size <= ch["bytes"] and ch["sha256"] != [f["sha256"]]:
        # one chunk is the whole file: its two digests must be the same (Note [both digests])
        raise CorruptFileError(
            f"{where}: {name}: sha256 {f['sha256'][:16]}... and its one chunk digest "
            f"{ch['sha256'][0][:16]}... differ (both cover the whole file)",
            hint="regenerate it: " + regenerate_hint(None, Path(where).parent),
        )


def _chunks_ok(ch: Any, size: int) -> bool:
    """A ``chunks`` record of a file of ``size`` bytes: a chunk size in range and one digest
    per chunk."""
    return (
        isinstance(ch, dict)
        and type(ch.get("bytes")) is int
        and 1 <= ch["bytes"] <= MAX_FILE_BYTES
        and isinstance(ch.get("sha256"), list)
        and len(ch["sha256"]) == max(1, -(-size // ch["bytes"]))
        and all(_is_digest(d) for d in ch["sha256"])
    )


#: The most bytes a file name may have (NAME_MAX on Linux).
MAX_NAME_BYTES = 255


def _is_plain_name(name: str) -> bool:
    """A file name a sidecar may list: printable (no control or format characters, no lone
    surrogates), no ``/``, not ``.`` or ``..``, at most ``MAX_NAME_BYTES`` in UTF-8."""
    return (
        name.isprintable()
        and "/" not in name
        and name not in ("", ".", "..")
        and len(name.encode()) <= MAX_NAME_BYTES
    )


def _check_source(src: dict[str, Any], where: str | os.PathLike) -> None:
    """``source``: its strings are strings, and ``files``, where given, a list of entries with
    a relative path, a size and one form of digest (FORMAT.md), so that ``verify --source`` and
    a re-conversion compare them without tripping on a type."""
    for key in ("kind", "path", "repo", "revision", "requested_revision", *SOURCE_CARD_KEYS):
        if src.get(key) is not None and not isinstance(src[key], str):
            raise CorruptFileError(
                f"{where}: source {key} is {quote(src[key], 40)}, not a string",
                hint=regenerate_hint_of({"source": {}}, Path(where).parent),
            )
    if src.get("kind") == "hub" and not (
        isinstance(src.get("repo"), str)
        and _is_repo_id(src["repo"])
        and (src.get("revision") is None or is_commit(src["revision"]))
    ):
        # verify looks a recorded Hub source up in the local cache by these two
        raise CorruptFileError(
            f"{where}: source repo {quote(src.get('repo'), 100)} at revision "
            f"{quote(src.get('revision'), 60)} is not a Hugging Face repo id at a commit",
            hint=regenerate_hint_of({"source": {}}, Path(where).parent),
        )
    for key in SOURCE_CARD_KEYS:  # the pushed card's metadata holds them as they are
        if src.get(key) is not None and not is_card_fact(key, src[key]):
            raise CorruptFileError(
                f"{where}: source {key} {quote(src[key], 100)} is not "
                + ("a Hugging Face repo id" if key == "base_model" else "a value a card takes"),
                hint=regenerate_hint_of({"source": {}}, Path(where).parent),
            )
    files = src.get("files", [])
    if not isinstance(files, list):
        raise CorruptFileError(
            f"{where}: source files is {quote(files, 40)}, not a list of file entries",
            hint=regenerate_hint_of({"source": src}, Path(where).parent),
        )
    for f in files:
        size = f.get("size") if isinstance(f, dict) else None
        ok = isinstance(f, dict) and type(size) is int and 0 <= size <= MAX_FILE_BYTES
        ok = ok and isinstance(f.get("name"), str) and _is_source_name(f["name"])
        # one form of digest, never both (Note [both digests])
        ok = ok and ("sha256" in f) != ("chunks" in f)
        ok = ok and (_is_digest(f["sha256"]) if "sha256" in f else _chunks_ok(f["chunks"], size))
        ok = ok and _is_digest(f.get("probe", "0" * 64))  # mpack/binding.py
        if not ok:
            raise CorruptFileError(
                f"{where}: malformed source files entry {quote(f)} (needs a relative name, a "
                "size, and sha256 or chunks, not both; a probe is a sha256)",
                hint=regenerate_hint_of({"source": src}, Path(where).parent),
            )


#: The forms of the licence keys of :data:`SOURCE_CARD_KEYS` (Note [card facts] in
#: convert/source.py): a Hub licence id or name, and a URL or a plain file name of the source.
_CARD_FACT_FORMS = {
    "license": re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]{0,99}"),
    "license_name": re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]{0,99}"),
    "license_link": re.compile(r"https?://[^\s<>\"'`\\]{1,400}|[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}"),
}


def is_card_fact(key: str, value: object) -> bool:
    """Whether ``value`` is of the form the ``source`` key ``key`` of :data:`SOURCE_CARD_KEYS`
    takes: a repo id for ``base_model``, else :data:`_CARD_FACT_FORMS`."""
    if not isinstance(value, str):
        return False
    if key == "base_model":
        return _is_repo_id(value)
    return bool(_CARD_FACT_FORMS[key].fullmatch(value))


#: One part of a Hugging Face repo id: ASCII letters, digits, ``_.-``, at most 96, starting and
#: ending with a letter, digit or ``_`` (huggingface_hub's own rule, checked without importing it).
_REPO_PART = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?")


def _is_repo_id(repo: str) -> bool:
    """``name`` or ``org/name``, as the Hub accepts it (no ``--``, ``..`` or ``.git`` end)."""
    parts = repo.split("/")
    return (
        len(parts) <= 2
        and all(_REPO_PART.fullmatch(p) for p in parts)
        and "--" not in repo
        and ".." not in repo
        and not repo.endswith(".git")
    )


def is_commit(rev: Any) -> bool:
    """A git commit id as the Hub and the HF cache name it: 40 lowercase hex digits."""
    return isinstance(rev, str) and len(rev) == 40 and all(c in "0123456789abcdef" for c in rev)


def _is_source_name(name: str) -> bool:
    """A source file's name: a printable path relative to the source directory, inside it."""
    parts = name.split("/")
    return name.isprintable() and not name.startswith("/") and ".." not in parts and "" not in parts


def load_manifest(sidecar: str | os.PathLike) -> tuple[dict[str, Any], str]:
    """Read and validate ``<sidecar>/mpack.json``; return ``(manifest, digest)``.

    The manifest must be a regular file (not a symlink, FIFO or device) of at most
    ``MAX_MANIFEST`` bytes.

    Raises:
        SourceNotFoundError: no such directory.
        InputError: a file where the sidecar directory belongs, or no manifest in it.
        CorruptFileError, FormatVersionError: from :func:`check_manifest`.
    """
    sidecar = Path(sidecar)
    path = sidecar / MANIFEST_NAME
    try:
        st = os.stat(sidecar)
    except OSError as e:
        raise os_error(e, sidecar, "sidecar directory") from None
    if not stat.S_ISDIR(st.st_mode):
        raise InputError(
            f"{sidecar}: is {kind_of(st.st_mode)}, not a sidecar directory",
            hint="pass the directory that `mpack convert -o DIR` wrote",
        )
    try:
        raw = read_capped(path, MAX_MANIFEST, what="manifest", follow=False)
    except SourceNotFoundError:
        from mpack.target_dirs import LISTED_TARGETS, target_names

        folders = target_names(sidecar)
        if folders:  # a directory of targets (Note [target layout] in mpack/target_dirs.py)
            more = len(folders) - LISTED_TARGETS
            names = ", ".join(shown(n) for n in folders[:LISTED_TARGETS])
            raise InputError(
                f"{sidecar}: a directory of {len(folders)} sidecar target(s) ({names}"
                + (f" and {more} more" if more > 0 else "")
                + "), not one sidecar",
                hint=f"give one target's folder, e.g. {sidecar / folders[0]}",
            ) from None
        raise InputError(
            f"{sidecar}: no {MANIFEST_NAME}: not a finished mpack sidecar",
            hint=f"if {sidecar} is a checkpoint, convert it: mpack convert {sidecar} -o "
            f"{sidecar.name or 'out'}-marlin",
        ) from None
    digest = hashlib.sha256(raw).hexdigest()  # Note [manifest digest]
    text = _manifest_text(raw, path)
    m = parse_json(text, path)
    if digest in _CHECKED:  # these very bytes passed every check below (Note [checked once])
        return m, digest
    if _SURROGATE_ESCAPE.search(text):  # rare: the walk runs only where an escape may be one
        where = _lone_surrogate(m)
        if where is not None:
            raise CorruptFileError(
                f"{path}: {where} holds a lone surrogate (a \\ud800-\\udfff escape that "
                "is not half of a pair): not Unicode text",
                hint=regenerate_hint_of(m if isinstance(m, dict) else {}, sidecar),
            )
    check_manifest(m, path)
    if len(_CHECKED) >= _CHECKED_MAX:
        _CHECKED.pop(next(iter(_CHECKED)))
    _CHECKED[digest] = None
    return m, digest


# Note [checked once]: every check load_manifest makes is a function of the manifest's bytes (and
# of this mpack), so a process checks each digest once: a later load of the same bytes (a second
# attach(), a daemon and its status) parses them and skips the checks; other bytes, even at the
# same path, are checked in full. The entries are digests only (nothing an attacker could steer
# but a hash), at most _CHECKED_MAX of them, oldest dropped first.
_CHECKED: dict[str, None] = {}
_CHECKED_MAX = 64


_BOMS = (
    (codecs.BOM_UTF32_LE, "UTF-32"),
    (codecs.BOM_UTF32_BE, "UTF-32"),
    (codecs.BOM_UTF8, "UTF-8"),
    (codecs.BOM_UTF16_LE, "UTF-16"),
    (codecs.BOM_UTF16_BE, "UTF-16"),
)
#: A JSON string escape of a UTF-16 surrogate; a lone one parses into a str no codec encodes.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def _manifest_text(raw: bytes, path: Path) -> str:
    """``mpack.json``'s bytes as text: UTF-8 without a byte order mark (FORMAT.md). Python's
    ``json.loads`` would take UTF-16 and UTF-32 as well, and UTF-8-encoded surrogates."""
    hint = f"write {MANIFEST_NAME} as UTF-8 without a byte order mark (mpack writes it so)"
    for bom, enc in _BOMS:
        if raw.startswith(bom):
            raise CorruptFileError(
                f"{path}: starts with a {enc} byte order mark; a manifest is UTF-8 without one",
                hint=hint,
            )
    if b"\0" in raw:  # JSON text has no NUL byte; UTF-16 and UTF-32 text of ASCII is full of them
        raise CorruptFileError(
            f"{path}: holds NUL bytes (UTF-16 or UTF-32 text?); a manifest is UTF-8", hint=hint
        )
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CorruptFileError(
            f"{path}: not UTF-8 (byte 0x{raw[e.start]:02x} at offset {e.start})", hint=hint
        ) from None


def _lone_surrogate(doc: Any) -> str | None:
    """Where in the parsed JSON ``doc`` a string (or a key) holds a lone surrogate, e.g.
    ``files[2].name``; None when none does."""
    stack: list[tuple[str, Any]] = [("the manifest", doc)]
    while stack:
        at, x = stack.pop()
        if isinstance(x, dict):
            for k, v in x.items():
                if not _is_unicode(k):
                    return f"a key of {at}"
                key = shown(k, 40)
                stack.append((key if at == "the manifest" else f"{at}.{key}", v))
        elif isinstance(x, list):
            stack.extend((f"{at}[{i}]", v) for i, v in enumerate(x))
        elif isinstance(x, str) and not _is_unicode(x):
            return at
    return None


def _is_unicode(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def expected_rank_tensors(m: Mapping[str, Any]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Every tensor a rank file must hold, as implied by the manifest's ``layers`` (FORMAT.md):
    name -> (safetensors dtype, shape). Every rank holds the same names and shapes."""
    act = m["target"]["act_dtype"]
    return {
        t: (dt, shape)
        for name, ly in m["layers"].items()
        for t, dt, shape in target.packed_specs(
            name, ly["np"], ly["kp"], act, ly["bias"], ly.get("experts")
        )
    }


def rank_tensor_problems(file_map: FileMap, m: Mapping[str, Any], name: str) -> list[str]:
    """How a rank file's tensors differ from :func:`expected_rank_tensors` (empty: they agree)."""
    expected = expected_rank_tensors(m)
    got = {e.name: (e.dtype, tuple(e.shape)) for e in file_map.entries}
    # names from the manifest and the header: escaped and capped (Note [quoting untrusted text])
    problems = [f"{name}: tensor {shown(t)} is missing" for t in sorted(set(expected) - set(got))]
    problems += [f"{name}: unexpected tensor {shown(t)}" for t in sorted(set(got) - set(expected))]
    problems += [
        f"{name}: {shown(t)} is {got[t]}, the manifest implies {expected[t]}"
        for t in sorted(set(got) & set(expected))
        if got[t] != expected[t]
    ]
    return problems


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


def digest_problems(f: Mapping[str, Any], got: Sequence[str]) -> list[str]:
    """How the digests ``got`` of a file differ from its files entry ``f``: ``got`` is its chunk
    digests where ``f`` records chunks, else one whole-file sha256 (empty: they agree). The one
    wording, whether the file was hashed on its own (:func:`check_files`) or as it streamed
    through ``mpack verify --source``."""
    ch = f.get("chunks")
    if ch:
        bad = chunk_mismatch(got, ch["sha256"], ch["bytes"], f["size"])
        if bad:
            i, lo, hi, nbad = bad
            return [
                f"{f['name']}: sha256 of bytes {lo}..{hi} is {got[i][:16]}..., "
                f"manifest says {ch['sha256'][i][:16]}... ({nbad} of {len(got)} chunks differ)"
            ]
        return []
    if got[0] != f["sha256"]:
        return [f"{f['name']}: sha256 {got[0][:16]}..., manifest says {f['sha256'][:16]}..."]
    return []


def _file_problems(fd: int, p: Path, f: Mapping[str, Any], digests: bool = True) -> list[str]:
    """How the open file ``fd`` differs from its files entry ``f``: size, then digests (the
    chunk digests only where ``digests``; the caller checks them otherwise), then a whole-file
    sha256 given beside several chunk digests (Note [both digests])."""
    size = os.fstat(fd).st_size
    if size != f["size"]:
        return [f"{f['name']}: size {size}, manifest says {f['size']}"]
    ch = f.get("chunks")
    if digests:
        if ch:  # the chunk digests cover every byte; the loader checks the same
            problems = digest_problems(f, fd_chunk_digests(fd, p, ch["bytes"], size))
        else:
            problems = digest_problems(f, [hash_fd_range(fd, p, 0, size)])
        if problems:
            return problems
    if ch and "sha256" in f and len(ch["sha256"]) > 1:
        whole = hash_fd_range(fd, p, 0, size)
        if whole != f["sha256"]:
            return [
                f"{f['name']}: sha256 of the whole file is {whole[:16]}..., manifest says "
                f"{f['sha256'][:16]}..."
            ]
    return []


# Note [both digests]: a files entry may carry a whole-file ``sha256`` beside its ``chunks``
# (copied files; every file of a version 1 sidecar). Both are checked, never one in place of the
# other: where the file is one chunk, the two digests are of the same bytes and must be equal,
# which check_manifest sees without reading the file (every reader refuses a manifest where
# they differ); where it is several chunks, ``mpack verify`` also hashes the whole file
# (check_files). The loader checks the chunk digests, which cover every byte, and does not
# spend a single-stream hash of a large file on the second digest. A ``source.files`` entry
# carries one form or the other, never both (FORMAT.md).


def sidecar_problems(
    sidecar: Path,
    m: dict[str, Any],
    *,
    hashed_elsewhere: Iterable[str] = (),
    progress: Callable[[int], None] | None = None,
) -> tuple[list[str], dict[str, FileMap]]:
    """``mpack verify``'s checks 1, without the source: :func:`check_files`, then every
    safetensors file's header, and the rank files' tensors against the manifest
    (:func:`rank_tensor_problems`). Returns the problems and the map of every safetensors
    file that parses. Used by ``mpack verify`` and by ``mpack push`` before it sends anything.
    ``progress(n)``: as :func:`check_files`."""
    problems = check_files(sidecar, m, hashed_elsewhere=hashed_elsewhere, progress=progress)
    file_maps: dict[str, FileMap] = {}
    for name in safetensors_files(m):  # every rank file is listed (check_manifest)
        try:
            file_maps[name] = read_file_map(sidecar / name, follow=False)
        except InputError as e:
            problems.append(str(e))
            continue
        if name != COMMON_NAME:
            problems += rank_tensor_problems(file_maps[name], m, name)
    return problems, file_maps


def check_files(
    sidecar: str | os.PathLike,
    manifest: Mapping[str, Any],
    *,
    hashed_elsewhere: Iterable[str] = (),
    progress: Callable[[int], None] | None = None,
) -> list[str]:
    """Re-hash every file listed in the manifest, and look for files it does not list; return one
    message per problem (empty = ok). Listed files must be regular files inside the sidecar
    (Note [trust model for files] in mpack/fsutil.py). ``hashed_elsewhere``: files whose size and
    kind are checked here but whose digests the caller checks as it reads them
    (:func:`digest_problems`). ``progress(n)`` is called after each listed file it opens, with its
    size in the manifest: the calls add up to the sidecar's bytes when every file is there."""
    problems = []
    elsewhere = set(hashed_elsewhere)
    listed = {f["name"] for f in manifest["files"]}
    for entry in sorted(os.listdir(sidecar)):
        if entry != MANIFEST_NAME and entry not in listed:
            problems.append(f"{shown(entry)}: not listed in the manifest (an unexpected file)")
    for f in manifest["files"]:
        p = Path(sidecar) / f["name"]
        try:
            fd = open_regular(p)  # follow=False: no symlinks, FIFOs or devices
        except InputError as e:
            problems.append(f"{f['name']}: {e.message.removeprefix(str(p) + ': ')}")
            continue
        try:  # one descriptor per file: the size and every digest come from the file checked
            problems += _file_problems(fd, p, f, digests=f["name"] not in elsewhere)
        finally:
            os.close(fd)
            if progress is not None:
                progress(f["size"])
    return problems
