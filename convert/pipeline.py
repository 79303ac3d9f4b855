"""The streaming convert pipeline: validate, plan, then read -> transform -> write, atomically.

Order of work (ARCHITECTURE.md "Data flow"):

1. resolve the source, parse every header, validate every layer (scales included) — any bad
   input is reported here, before a byte is written;
2. plan every output tensor (:mod:`mpack.convert.plan`);
3. if OUT already holds this sidecar (same source files, same target), stop: up to date;
4. stream the fused layers through three stages on their own threads — read (from the shards,
   on CUDA into pinned staging rings and on to the GPU on a copy stream), transform (on the chosen
   device), write (at the planned offset, chunk digests and disk writeback behind it) — with a
   few units in flight (:mod:`mpack.convert.stream`), so memory is bounded whatever the model;
   with compressed-tensors not yet imported, its check of the config runs meanwhile in a forked
   child, and its verdict is awaited before anything becomes visible;
5. check that no source file changed under the run (Note [stable source] in
   :mod:`mpack.convert.source`), write the manifest last, into a hidden work directory next to
   OUT, and swap it into place.

Note [atomic output]: nothing named OUT exists until the final rename; a killed run leaves only
a work directory ``.mpack-<key>.tmp-<rand>`` behind (no manifest at OUT), which the next run
removes. ``<key>``: 12 hex digits of the sha256 of OUT's name, so every hidden name has a fixed
length (an OUT name of 255 bytes still fits) and belongs to one OUT.

Note [output lock]: a run holds ``.mpack-<key>.lock`` (an ``flock``, :class:`mpack.fsutil.LockFile`)
in OUT's parent from before it reads the source until OUT is in place; a second run for the
same OUT stops at once with ``BusyError``. The kernel drops the lock when its holder dies,
whatever its pid namespace, so a work or old directory of this OUT found while we hold the lock
belongs to no live run: it is removed (those named the old way, ``.<OUT>.mpack-tmp-<pid>-<rand>``
and ``.<OUT>.mpack-old-<pid>-<rand>``, too). Pids play no part in it.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import hashlib
import os
import re
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mpack.convert import cuda_repack, marlin
from mpack.convert.checkpoint import (
    BIAS,
    Checkpoint,
    check_scale_values,
    find_layers,
    layer_summary,
    open_checkpoint,
    read_scale,
)
from mpack.convert.plan import OutLayer, Plan, make_plan
from mpack.convert.scheme_check import SchemeCheck
from mpack.convert.source import (
    ResolvedSource,
    SourceChangedError,
    Stamp,
    candidate_files,
    check_sources_unchanged,
    hash_sources,
    provenance,
    record_forms,
    resolve_source,
    source_changes,
    source_files,
    stamp_sources,
)
from mpack.convert.stream import Streamer
from mpack.convert.timeline import Timeline
from mpack.errors import (
    BusyError,
    InputError,
    MpackError,
    OutputExistsError,
    UnsupportedSchemeError,
    UsageError,
)
from mpack.fsutil import LockFile, LockHeld, os_error
from mpack.sidecar import (
    CHUNK_BYTES,
    COMMON_NAME,
    COPIED_FILES,
    FUSIONS,
    MANIFEST_NAME,
    MODEL_CONFIG_KEYS,
    PROFILES,
    HashingWriter,
    fsync_dir,
    load_manifest,
    new_manifest,
    write_manifest,
)

Progress = Callable[[str, int, int], None]  # (stage, done, total): "bytes" / "layers"
COPY_CHUNK = 16 * 1024 * 1024


@dataclass
class ConvertResult:
    """What a conversion did: the manifest it wrote (or found), and how long each phase took.

    ``out``: the sidecar directory (symlinks resolved); ``digest``: the manifest digest;
    ``up_to_date``: ``out`` already held this sidecar, nothing was done; ``seconds``: phase ->
    seconds (``"total"`` once work was done); ``bytes_written``: bytes of the safetensors files
    written (0 when up to date); ``timeline``: ``(lane, what, start, end)`` spans, for benchmarks.
    """

    out: Path
    manifest: dict[str, Any]
    digest: str
    up_to_date: bool
    seconds: dict[str, float] = field(default_factory=dict)
    bytes_written: int = 0
    timeline: list[tuple[str, str, float, float]] = field(default_factory=list)


# --- options ------------------------------------------------------------------------------


def resolve_device(device: str) -> torch.device:
    """``auto`` -> CUDA when present, else CPU; ``cpu``; ``cuda`` / ``cuda:i``."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise UsageError(f"--device must be auto, cpu, cuda or cuda:<i>, got {device!r}") from None
    if dev.type not in ("cpu", "cuda"):
        raise UsageError(f"--device must be auto, cpu, cuda or cuda:<i>, got {device!r}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(
                "--device cuda: no CUDA device here", hint="use --device cpu (identical bytes)"
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise UsageError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s)")
    return dev


def _check_options(profile: str, act_dtype: str | None, tp: int, fuse: str) -> None:
    if profile not in PROFILES:
        raise UsageError(f"--profile must be one of {', '.join(PROFILES)}, got {profile!r}")
    if act_dtype is not None and act_dtype not in marlin.ACT_DTYPES:
        raise UsageError(f"--act-dtype must be bfloat16 or float16, got {act_dtype!r}")
    if fuse not in FUSIONS:
        raise UsageError(f"--fuse must be one of {', '.join(FUSIONS)}, got {fuse!r}")
    if tp < 1:
        raise UsageError(f"--tp must be at least 1, got {tp}")
    if fuse == "none" and tp != 1:
        raise UsageError(
            f"--fuse none packs layers under checkpoint names and needs --tp 1 (got --tp {tp})"
        )


def _act_dtype(ck: Checkpoint, requested: str | None) -> str:
    if requested:
        return requested
    dt = ck.dtype
    if dt in marlin.ACT_DTYPES:
        return dt
    raise UnsupportedSchemeError(
        f"{ck.root / 'config.json'}: model dtype {dt!r} is not an activation dtype Marlin supports",
        hint="pass --act-dtype bfloat16 or --act-dtype float16",
    )


# --- the per-layer transform (SPEC §3) ----------------------------------------------------


@dataclass
class Fused:
    """One rank's layer before packing: what the Marlin tensors encode, in checkpoint terms."""

    weight: torch.Tensor  # uint8 [N, K]: fused, sliced, and requantized when the layer is
    scale: torch.Tensor  # float32 [N]: one scale per output channel
    bias: torch.Tensor | None  # [N] in the checkpoint's dtype


def fuse(layer: OutLayer, src: dict[str, torch.Tensor]) -> Fused:
    """Fuse and slice the checkpoint pieces of ``layer`` (SPEC §3.1-§3.2, §6).

    Args:
        src: per checkpoint module, ``<module>.weight`` uint8 ``[N, K]``,
            ``<module>.weight_scale`` float32 ``[1]`` or ``[N]``, and ``<module>.bias`` if any.
    """
    rows = [
        src[f"{p.module}.weight"][p.rows[0] : p.rows[1], p.cols[0] : p.cols[1]]
        for p in layer.pieces
    ]
    w = torch.cat(rows) if len(rows) > 1 else rows[0].contiguous()  # uint8 [N, K]
    if layer.strategy == "channel":
        scale_n = torch.cat(
            [src[f"{p.module}.weight_scale"][p.rows[0] : p.rows[1]] for p in layer.pieces]
        )
    else:
        shard_scales = torch.cat(
            [src[f"{p.module}.weight_scale"] for p in layer.pieces]
        )  # fp32 [S]
        if layer.requant:
            w, s_max = marlin.requantize_shards(w, shard_scales, layer.widths)
            scale_n = marlin.broadcast_scales(torch.tensor([s_max], dtype=torch.float32), layer.n)
        else:
            scale_n = marlin.broadcast_scales(shard_scales, layer.n, layer.widths)
    bias = None
    if layer.has_bias:
        bias = torch.cat([src[f"{p.module}.{BIAS}"][p.rows[0] : p.rows[1]] for p in layer.pieces])
    return Fused(w, scale_n, bias)


def pack(
    layer: OutLayer, f: Fused, act_dtype: str, pool: Executor | None = None
) -> list[torch.Tensor]:
    """One rank's Marlin tensors for a fused layer, in the order of its tensor specs.

    The weight is packed where it is (the fused kernel on CUDA); the scales and bias, a few KB,
    are computed on the host. The bytes are the same on every device. ``pool``: threads for the
    CPU repack's blocks (:func:`mpack.convert.marlin.block_pool`).

    Returns:
        ``[weight int32 [Kp/16, 4Np], weight_scale dt [1, Np], (bias dt [Np])]``.
    """
    dt = marlin.ACT_DTYPES[act_dtype]
    out = [
        cuda_repack.pack_weight_fast(f.weight, layer.np_, layer.kp, pool),
        marlin.pack_scales(f.scale.cpu(), dt, layer.np_),
    ]
    if f.bias is not None:
        out.append(marlin.pack_bias(f.bias.cpu(), dt, layer.np_))
    return out


def transform(
    layer: OutLayer, src: dict[str, torch.Tensor], act_dtype: str, pool: Executor | None = None
) -> list[torch.Tensor]:
    """:func:`fuse` then :func:`pack`: the checkpoint pieces of ``layer`` -> its Marlin tensors."""
    return pack(layer, fuse(layer, src), act_dtype, pool)


# --- validation of values -----------------------------------------------------------------


def validate_values(ck: Checkpoint, plan: Plan) -> None:
    """Scale values of every layer (SPEC §1), read before any heavy work."""
    for module in ck.layers:
        check_scale_values(ck, module, read_scale(ck, module), plan.act_dtype)


# --- output directory ---------------------------------------------------------------------


def output_path(out: str | os.PathLike) -> Path:
    """The directory ``-o out`` names, made absolute and checked before any work.

    Note [output path]: ``out`` is resolved through symbolic links (``os.path.realpath``) and
    the sidecar is written at the target: ``-o link`` where ``link -> some/dir`` fills
    ``some/dir`` and keeps the link, so the link never turns into a directory and two runs
    through different links to one directory share one lock.

    Raises:
        UsageError: ``out`` is empty, the current directory or one of its ancestors (the run
            would replace it), a mount point (it cannot be renamed into place), or a symbolic
            link that does not resolve (a loop).
    """
    raw = os.fspath(out)
    if not raw:
        raise UsageError("-o is empty", hint="name a new directory, e.g. -o ./sidecar")
    p = Path(os.path.realpath(Path(raw).expanduser()))
    if p.is_symlink():
        raise UsageError(f"-o {raw}: a symbolic link that does not resolve (a loop?)")
    try:
        cwd = Path(os.path.realpath(os.getcwd()))
    except FileNotFoundError:  # the current directory was removed: -o is absolute, or fails later
        cwd = None
    if cwd is not None and (p == cwd or p in cwd.parents):
        what = "is the current directory" if p == cwd else "contains the current directory"
        raise UsageError(
            f"-o {raw} ({p}) {what}; the sidecar would replace it",
            hint="name a new directory, e.g. -o ./sidecar",
        )
    if os.path.ismount(p):
        raise UsageError(
            f"-o {raw} ({p}) is a mount point, which a finished sidecar cannot be renamed onto",
            hint=f"use a subdirectory of it, e.g. -o {p / 'sidecar'}",
        )
    return p


def _check_apart(out: Path, source: Path) -> None:
    """Refuse an output inside the source, or a source inside the output (both resolved)."""
    src = Path(os.path.realpath(source))
    if out == src or src in out.parents:
        raise UsageError(
            f"-o {out} lies inside the source checkpoint {src}; choose another output directory"
        )
    if out in src.parents:
        raise UsageError(
            f"the source checkpoint {src} lies inside -o {out}, which the sidecar would replace",
            hint="choose an output directory outside the checkpoint",
        )


def _key(out: Path) -> str:
    """12 hex digits naming ``out``'s lock and work directories (Note [atomic output])."""
    return hashlib.sha256(os.fsencode(out.name)).hexdigest()[:12]


def lock_path(out: Path) -> Path:
    """The lock file of a run writing ``out`` (Note [output lock])."""
    return out.parent / f".mpack-{_key(out)}.lock"


def _work_path(out: Path, kind: str) -> Path:
    """A new work (``tmp``) or old-sidecar (``old``) directory name for ``out``."""
    return out.parent / f".mpack-{_key(out)}.{kind}-{uuid.uuid4().hex[:8]}"


def work_dirs(out: Path) -> list[Path]:
    """Work and old-sidecar directories of runs for ``out``, new and old naming, sorted."""
    if not out.parent.is_dir():
        return []
    ours = re.compile(
        rf"\.mpack-{_key(out)}\.(tmp|old)-[0-9a-f]{{8}}"  # this mpack's names
        rf"|\.{re.escape(out.name)}\.mpack-(tmp|old)-\d+-[0-9a-f]{{8}}"  # older mpacks'
    )
    return sorted(out.parent / n for n in os.listdir(out.parent) if ours.fullmatch(n))


def clean_stale(out: Path) -> None:
    """Remove every work and old-sidecar directory of ``out``; call with ``out``'s lock held,
    when none of them can belong to a live run (Note [output lock])."""
    for p in work_dirs(out):
        _remove(p)


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            p.unlink()


@contextlib.contextmanager
def output_lock(out: Path) -> Iterator[None]:
    """Hold ``out``'s lock (Note [output lock]), creating ``out``'s parent directories as needed;
    those it created are removed again if they are empty at the end (a refused run leaves
    nothing). Where this process cannot write ``out``'s parent (a read-only mount of sidecars),
    no lock is taken: the run can then only find ``out`` up to date, or fail when it writes.

    Raises:
        BusyError: another run holds the lock.
        InputError, EnvironmentFailure: the parent cannot be created, or the lock file is not
            one we can trust (:class:`mpack.fsutil.LockFile`).
    """
    with contextlib.ExitStack() as stack:
        made = _make_dirs(out.parent)
        stack.callback(_remove_empty, made)
        if not os.access(out.parent, os.W_OK):
            yield
            return
        try:
            stack.enter_context(LockFile(lock_path(out)))
        except LockHeld as e:
            raise BusyError(
                f"another mpack convert (pid {e.pid}) is writing {out}",
                hint="wait for it to finish, or stop it",
            ) from None
        clean_stale(out)  # under the lock, no work directory of OUT belongs to a live run
        yield


def _make_dirs(d: Path) -> list[Path]:
    """Create ``d`` and its missing parents; return those created, outermost first."""
    missing = []
    while not d.exists() and d != d.parent:
        missing.append(d)
        d = d.parent
    made: list[Path] = []
    for m in reversed(missing):
        try:
            m.mkdir()
        except FileExistsError:
            continue  # made by someone else meanwhile
        except OSError as e:
            _remove_empty(made)
            raise os_error(e, m, "directory") from None
        made.append(m)
    return made


def _remove_empty(dirs: list[Path]) -> None:
    for d in reversed(dirs):
        with contextlib.suppress(OSError):
            d.rmdir()


#: target keys compared, in the order differences are listed (then any others)
TARGET_KEYS = ("tp_size", "profile", "act_dtype", "fusion", "engine_version", "engine", "kernel")
MAX_LISTED_DIFFS = 3


@dataclass
class Existing:
    """What ``-o`` holds already (:func:`existing_state`)."""

    state: str  # absent | empty | same (this sidecar, intact) | other-sidecar | foreign
    loaded: tuple[dict[str, Any], str] | None = None  # its manifest and digest, when readable
    differences: list[str] = field(default_factory=list)  # other-sidecar: how, for people


def existing_state(
    out: Path,
    target: dict[str, Any],
    files: Callable[..., list[dict[str, Any]]] | None,
    common: bool,
    src: ResolvedSource,
) -> Existing:
    """What ``out`` holds: ``absent`` | ``empty`` | ``same`` (this sidecar, intact) |
    ``other-sidecar`` | ``foreign``, with the existing manifest and digest when they could be
    loaded, and for ``other-sidecar`` what differs from the planned one
    (:func:`sidecar_differences`).

    ``files(forms=None)`` gives the source's file records (it may wait for their hashes; ``forms``
    as in :func:`hash_sources`); None: the caller replaces any sidecar anyway (``--force``), so
    an mpack sidecar is reported as ``other-sidecar`` without hashing the source (or listing
    differences). ``src``: the source, whose manifest record is compared.
    """
    if not out.exists():
        return Existing("absent")
    if out.is_dir() and not any(out.iterdir()):
        return Existing("empty")
    if not (out / MANIFEST_NAME).is_file():
        return Existing("foreign")
    try:
        loaded = load_manifest(out)
    except InputError as e:
        return Existing("other-sidecar", None, [f"its {MANIFEST_NAME} cannot be used: {e}"])
    m = loaded[0]
    if files is None:
        return Existing("other-sidecar", loaded)
    has_common = any(f["name"] == COMMON_NAME for f in m["files"])
    recorded = m["source"].get("files")
    now = files()
    if recorded != now and isinstance(recorded, list):
        forms = record_forms(recorded)
        if forms != record_forms(now):
            now = files(forms)  # written by an mpack that recorded other digests
    same = m["target"] == target and has_common == common and recorded == now
    broken = [
        f["name"]
        for f in m["files"]
        if not ((out / f["name"]).is_file() and (out / f["name"]).stat().st_size == f["size"])
    ]
    if same and not broken:
        return Existing("same", loaded)
    diffs = sidecar_differences(m, target, common, provenance(src, now))
    diffs += [f"its {n} is missing or has the wrong size" for n in broken[:MAX_LISTED_DIFFS]]
    return Existing("other-sidecar", loaded, diffs)


def sidecar_differences(
    m: dict[str, Any], target: dict[str, Any], common: bool, source: dict[str, Any]
) -> list[str]:
    """How the sidecar of manifest ``m`` differs from the one planned (``target``, whether it
    has ``common.safetensors``, the planned manifest's ``source``), one ``what old -> new``
    phrase per difference: target keys, pass-through, source repo / path / revision, and which
    source files changed, appeared or went away."""
    diffs = []
    old_t = m.get("target") or {}
    for k in [*TARGET_KEYS, *sorted((set(old_t) | set(target)) - set(TARGET_KEYS))]:
        if old_t.get(k) != target.get(k):
            diffs.append(f"{k} {_short(old_t.get(k))} -> {_short(target.get(k))}")
    had_common = any(f.get("name") == COMMON_NAME for f in m.get("files") or [])
    if had_common != common:
        yes = {True: f"with {COMMON_NAME}", False: f"without {COMMON_NAME}"}
        diffs.append(f"pass-through {yes[had_common]} -> {yes[common]}")
    old_s = m.get("source") if isinstance(m.get("source"), dict) else {}
    if old_s.get("kind") != source.get("kind"):
        diffs.append(f"source {_origin(old_s)} -> {_origin(source)}")
    else:
        for k, n in (("repo", 200), ("path", 4096), ("revision", 12)):
            if old_s.get(k) != source.get(k):
                diffs.append(f"source {k} {_short(old_s.get(k), n)} -> {_short(source.get(k), n)}")
    diffs += _file_differences(old_s.get("files"), source.get("files"))
    return diffs


def _file_differences(old: Any, new: Any) -> list[str]:
    """``source file X changed`` (``added``, ``removed``) for the first few, then a count."""
    if not isinstance(new, list):
        return []
    if not isinstance(old, list):
        return ["source files not recorded -> recorded"]
    a = {r.get("name"): r for r in old if isinstance(r, dict)}
    b = {r["name"]: r for r in new}
    changed = [
        f"source file {_short(n, 200)} {what}"
        for n, what in sorted(
            [(n, "changed") for n in a.keys() & b.keys() if a[n] != b[n]]
            + [(n, "added") for n in b.keys() - a.keys()]
            + [(n, "removed") for n in a.keys() - b.keys()],
            key=lambda x: str(x[0]),
        )
    ]
    if len(changed) > MAX_LISTED_DIFFS:
        more = len(changed) - MAX_LISTED_DIFFS
        changed = changed[:MAX_LISTED_DIFFS] + [f"{more} more source file(s) differ"]
    return changed


def _origin(s: dict[str, Any]) -> str:
    if s.get("kind") == "hub":
        return f"{_short(s.get('repo'), 200)}@{_short(s.get('revision'), 12)}"
    return f"{_short(s.get('kind'))} {_short(s.get('path'), 4096)}"


def _short(v: Any, n: int = 40) -> str:
    """A manifest value for a message: ``none`` for a missing one, cut to ``n`` characters."""
    return "none" if v is None else str(v)[:n]


def _swap_into_place(tmp: Path, out: Path) -> None:
    """Put ``tmp`` at ``out``. An existing ``out`` is exchanged with ``tmp`` in one atomic step
    (``renameat2(RENAME_EXCHANGE)``: ``out`` never goes missing) and then removed from there;
    where the file system cannot exchange, it is renamed aside first. Either way, what a kill
    in between leaves is a work or old directory that the next run removes."""
    if not (out.exists() or out.is_symlink()):
        os.rename(tmp, out)
        fsync_dir(out.parent)
        return
    if _exchange(tmp, out):
        fsync_dir(out.parent)
        _remove(tmp)  # the old OUT
        return
    old = _work_path(out, "old")
    os.rename(out, old)
    os.rename(tmp, out)
    fsync_dir(out.parent)
    _remove(old)


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


@functools.cache
def _renameat2() -> Any:
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # no such call in this libc (glibc < 2.28, macOS)
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def _exchange(a: Path, b: Path) -> bool:
    """Swap ``a`` and ``b`` atomically; False where the system or file system cannot."""
    fn = _renameat2()
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


# --- the run ------------------------------------------------------------------------------


def run_convert(
    source: str | os.PathLike,
    out: str | os.PathLike,
    *,
    revision: str | None = None,
    profile: str = "w8a16",
    act_dtype: str | None = None,
    tp: int = 1,
    fuse: str = "vllm",
    device: str = "auto",
    passthrough: bool = True,
    force: bool = False,
    progress: Progress | None = None,
    scheme_check: SchemeCheck | None = None,
) -> ConvertResult:
    """Convert a compressed-tensors FP8 checkpoint into a Marlin sidecar at ``out``.

    See :func:`mpack.convert.convert` for the arguments. Raises an ``MpackError`` (exit code 2)
    for bad input, before anything is written. ``scheme_check``: the check of this source,
    already started by the caller (the CLI forks it before importing torch); it is used when its
    directory is the resolved source, and cancelled otherwise.

    ``out`` is resolved through symbolic links and the sidecar written at the target, keeping
    the link (Note [output path]); an empty ``out``, the current directory, a mount point, an
    output inside the source or a source inside the output are refused up front. The run holds
    ``out``'s lock throughout (Note [output lock]): ``BusyError`` if another run writes ``out``.
    A source file that changes while it is converted stops the run with ``SourceChangedError``,
    nothing written (Note [stable source] in :mod:`mpack.convert.source`).
    """
    t0 = time.perf_counter()
    _check_options(profile, act_dtype, tp, fuse)
    dev = resolve_device(device)
    out = output_path(out)
    src: ResolvedSource = resolve_source(str(source), revision, show_progress=progress is not None)
    _check_apart(out, src.path)
    with output_lock(out):
        stamps = stamp_sources(src)  # before anything of the source is read
        try:
            return _run_locked(
                src, out, dev, stamps, t0, profile=profile, act_dtype=act_dtype, tp=tp, fuse=fuse,
                passthrough=passthrough, force=force, progress=progress, scheme_check=scheme_check,
            )  # fmt: skip
        except Exception as e:
            # a failure on a source that changed meanwhile (a shard truncated or removed under
            # a read) is reported as that change: the cause to fix
            changed = None
            if not isinstance(e, SourceChangedError):
                with contextlib.suppress(MpackError, OSError):
                    changed = source_changes(src, stamps)
            if changed is None:
                raise
            raise changed from e


def _run_locked(
    src: ResolvedSource,
    out: Path,
    dev: torch.device,
    stamps: dict[str, Stamp],
    t0: float,
    *,
    profile: str,
    act_dtype: str | None,
    tp: int,
    fuse: str,
    passthrough: bool,
    force: bool,
    progress: Progress | None,
    scheme_check: SchemeCheck | None,
) -> ConvertResult:
    """:func:`run_convert` once ``out``'s lock is held and the source stamped."""
    tl = Timeline(t0)
    seconds: dict[str, float] = {}
    # The compressed-tensors check may run in a forked child while this process plans from the
    # headers and streams (Note [scheme check in a child]); it is forked before any thread starts.
    check = scheme_check
    if check is None or check.root.resolve() != src.path.resolve():
        if check is not None:
            check.cancel()
        check = SchemeCheck(src.path)
    # Source hashing starts now, on its own threads: it overlaps validation and the conversion,
    # and warms the page cache for the reads. A failed run stops it.
    stop = threading.Event()
    hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mpack-hash")
    early = hasher.submit(hash_sources, src, candidate_files(src), stop=stop, timeline=tl)
    try:
        try:
            ck = open_checkpoint(src.path, scheme=not check.in_child)
            find_layers(ck)
            plan = make_plan(ck, profile=profile, act_dtype=_act_dtype(ck, act_dtype), tp=tp,
                             fusion=fuse, passthrough=passthrough)  # fmt: skip
            validate_values(ck, plan)
        except MpackError:
            if check.in_child:
                check.result()  # its error first: the same order as the inline check
            raise
        seconds["validate"] = time.perf_counter() - t0
        tl.add("main", "validate", t0, time.perf_counter())
        names = source_files(src, ck.files)

        @functools.cache
        def early_hashes() -> list[dict[str, Any]]:
            got = {r["name"]: r for r in early.result()}
            missing = [n for n in names if n not in got]
            got.update((r["name"], r) for r in hash_sources(src, missing) if missing)
            return [got[n] for n in names]

        def source_hashes(forms: dict[str, str] | None = None) -> list[dict[str, Any]]:
            return early_hashes() if forms is None else hash_sources(src, names, forms=forms)

        if out.exists():
            t = time.perf_counter()
            there = existing_state(
                out, plan.target, None if force else source_hashes, common=COMMON_NAME in plan.files,
                src=src,
            )  # fmt: skip
            seconds["hash_sources"] = time.perf_counter() - t
            if there.state == "same" and there.loaded is not None and not force:
                check_sources_unchanged(src, stamps)  # the digests compared are of these files
                m, digest = there.loaded
                return ConvertResult(out, m, digest, up_to_date=True, seconds=seconds)
            if there.state == "foreign":
                raise OutputExistsError(
                    f"{out} already holds files that are not an mpack sidecar",
                    hint="choose another -o directory, or remove it yourself (mpack does not "
                    "delete what it did not write)",
                )
            if there.state == "other-sidecar" and not force:
                how = f" ({', '.join(there.differences)})" if there.differences else ""
                raise OutputExistsError(
                    f"{out} already holds a different sidecar{how}",
                    hint="pass --force to replace it, or choose another -o directory",
                )
        tmp = _work_path(out, "tmp")
        tmp.mkdir()
        try:
            written = _write_all(plan, tmp, dev, progress, seconds, tl)
            with tl.span("main", "copy-files"):
                copied = [_copy_file(src.path / n, tmp / n) for n in names if n in COPIED_FILES]
            t = time.perf_counter()
            files_src = early_hashes()
            seconds["wait_source_hashes"] = time.perf_counter() - t
            tl.add("main", "wait-source-hashes", t, time.perf_counter())
            t = time.perf_counter()
            if check.in_child:  # inline, the first open_checkpoint already ran the full check
                _agree(check, ck)
            seconds["wait_scheme_check"] = time.perf_counter() - t
            tl.add("main", "wait-scheme-check", t, time.perf_counter())
            t = time.perf_counter()
            # every read of the source is done: the bytes converted and hashed are those stamped
            check_sources_unchanged(src, stamps)
            file_records = [{"name": n, **written[n]} for n in sorted(written)] + copied
            manifest = new_manifest(
                target=plan.target,
                source=provenance(src, files_src),
                model={"architecture": ck.architecture, "config": _model_summary(ck)},
                layers=plan.layers_manifest(),
                files=sorted(file_records, key=lambda f: f["name"]),
            )
            digest = write_manifest(tmp, manifest)
            fsync_dir(tmp)
            t = tl.add("main", "manifest", t, time.perf_counter())
            with tl.span("main", "swap"):
                _swap_into_place(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    except BaseException:
        stop.set()
        raise
    finally:
        check.cancel()
        hasher.shutdown(wait=True)
    seconds["total"] = time.perf_counter() - t0
    return ConvertResult(out, manifest, digest, up_to_date=False, seconds=seconds,
                         bytes_written=plan.total_bytes, timeline=tl.spans())  # fmt: skip


def _agree(check: SchemeCheck, ck: Checkpoint) -> None:
    """The child's verdict (raises its error); its layers must be those planned from headers."""
    layers, planned = check.result(), layer_summary(ck.layers)
    if layers != planned:
        diff = sorted(m for m in set(layers) | set(planned) if layers.get(m) != planned.get(m))
        raise MpackError(
            f"{ck.root}: the quantization config and the tensor headers disagree on {diff[:3]}",
            hint="run again with MPACK_SCHEME_CHECK=inline, and please report this",
        )


def _copy_file(a: Path, b: Path) -> dict[str, Any]:
    """Copy ``a`` to ``b`` (fsynced), hashing the bytes on the way: its ``files`` record, with
    the whole-file sha256 and the chunk digests (FORMAT.md), from one read."""
    whole, chunks, chunk, size = hashlib.sha256(), [], hashlib.sha256(), 0
    with open(a, "rb", buffering=0) as fa, open(b, "wb") as fb:
        while data := fa.read(min(COPY_CHUNK, CHUNK_BYTES - size % CHUNK_BYTES)):
            fb.write(data)
            whole.update(data)
            chunk.update(data)
            size += len(data)
            if size % CHUNK_BYTES == 0:
                chunks.append(chunk.hexdigest())
                chunk = hashlib.sha256()
        fb.flush()
        os.fsync(fb.fileno())
    if size == 0 or size % CHUNK_BYTES:
        chunks.append(chunk.hexdigest())  # the last, shorter chunk (one chunk = the whole file)
    return {"name": b.name, "size": size, "sha256": whole.hexdigest(),
            "chunks": {"bytes": CHUNK_BYTES, "sha256": chunks}}  # fmt: skip


def _model_summary(ck: Checkpoint) -> dict[str, Any]:
    c = ck.text_config
    return {k: c[k] for k in MODEL_CONFIG_KEYS if k in c} | {"dtype": ck.dtype}


def _write_all(plan: Plan, tmp: Path, dev: torch.device, progress: Progress | None,
               seconds: dict[str, float], tl: Timeline) -> dict[str, dict[str, Any]]:  # fmt: skip
    """Stream every output file into ``tmp``; return ``{file: {size, sha256, chunks}}``.

    The Marlin layers go through :class:`mpack.convert.stream.Streamer` (read, transform and
    write on their own threads, pinned staging rings on CUDA); pass-through tensors are copied
    on another thread, into their own file, at the same time. Each file hashes as it is written
    (:class:`mpack.sidecar.HashingWriter`).
    """
    ck = plan.ckpt
    t_setup = time.perf_counter()
    writers = {name: HashingWriter(tmp / name, layout, whole_file=False)
               for name, layout in plan.files.items()}  # fmt: skip
    total, done, lock = plan.total_bytes, 0, threading.Lock()
    phase: dict[str, float] = {}

    def bump(n: int) -> None:
        nonlocal done
        with lock:
            done += n
            if progress:
                progress("bytes", done, total)

    def on_unit(i: int) -> None:
        if progress:
            progress("layers", i, len(plan.units))

    def passthrough() -> None:
        t = time.perf_counter()
        try:
            _copy_passthrough(ck, writers[COMMON_NAME], bump, tl)
        finally:
            phase["passthrough_busy"] = time.perf_counter() - t

    stack = contextlib.ExitStack()
    try:
        for w in writers.values():
            bump(w.position)
        # CPU: the repack's blocks on a pool of threads (Note [repack in blocks])
        pool = stack.enter_context(marlin.block_pool()) if dev.type == "cpu" else None
        streamer = Streamer(
            plan,
            writers,
            dev,
            functools.partial(transform, act_dtype=plan.act_dtype, pool=pool),
            bump,
            on_unit,
            tl,
        )
        t = tl.add("main", "setup", t_setup, time.perf_counter())
        with ThreadPoolExecutor(1, thread_name_prefix="mpack-copy") as copier:
            copied = copier.submit(passthrough) if COMMON_NAME in writers else None
            try:
                streamer.run()
            except BaseException:
                if copied is not None:
                    copied.cancel()
                raise
            if copied is not None:
                copied.result()
        t = tl.add("main", "stream", t, time.perf_counter())
        result = {}
        for name, w in writers.items():
            size, _ = w.finish()  # chunk digests only (FORMAT.md, format version 2)
            result[name] = {"size": size, "chunks": {"bytes": w.chunk_bytes, "sha256": w.chunks}}
        phase["finish"] = time.perf_counter() - t
        tl.add("main", "finish", t, time.perf_counter())
        phase.update(
            {k if k.endswith("_wait") else f"{k}_busy": v for k, v in streamer.busy.items()}
        )
        seconds.update(phase)
        return result
    finally:
        stack.close()
        for w in writers.values():
            w.close()


def _copy_passthrough(
    ck: Checkpoint, w: HashingWriter, bump: Callable[[int], None], tl: Timeline
) -> None:
    """Copy pass-through tensors byte for byte, in file order, through one reused buffer."""
    buf = memoryview(bytearray(COPY_CHUNK))
    for entry in w.layout.entries:
        for pos in range(0, entry.nbytes, COPY_CHUNK):
            view = buf[: min(COPY_CHUNK, entry.nbytes - pos)]
            t = time.perf_counter()
            ck.read_into(entry.name, view, pos)
            t = tl.add("copy", "read", t, time.perf_counter())
            w.write_at(entry.offset + pos, view)
            tl.add("copy", COMMON_NAME, t, time.perf_counter())
            bump(len(view))
