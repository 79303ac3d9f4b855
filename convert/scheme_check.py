"""The full validation of a checkpoint (compressed-tensors' own parse of its config included),
overlapped with the conversion in a forked child (Note [scheme check in a child]).

This module imports neither torch nor compressed-tensors, so that ``mpack convert`` can fork the
child before it imports torch itself: the child's imports then overlap the parent's.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mpack import __version__, cache, env_flag
from mpack.errors import MpackError
from mpack.fsutil import parse_json

if TYPE_CHECKING:
    from mpack.convert.checkpoint import Checkpoint

# Note [scheme check in a child]: compressed-tensors imports transformers (and with it
# torch.distributed, sympy, torch._dynamo), which takes longer than streaming an 8B model (figures:
# docs/BENCHMARKS.md, sections 2 and 9). Nothing in the plan needs it: which tensors form a
# quantized linear, and its strategy, follow from the safetensors headers (an F8_E4M3 weight with a
# weight_scale of one value or N values). The config is the cross-check. So `mpack convert` plans
# from the headers (``open_checkpoint(scheme=False)``) and runs the full check (``open_checkpoint``
# + ``find_layers``, with compressed-tensors' own models) in a forked child that imports it on
# another core while the parent streams. The parent waits for the child's verdict before anything
# becomes visible: a failed check removes the work directory, and its error is the same, word for
# word, as the inline check's. Where compressed-tensors is already imported (a library caller, the
# tests) or fork is unavailable, the check runs inline. mpack.convert.start (the CLI and
# convert()) starts the child for a local source first thing, before anything imports torch. Even
# in a child, the full import (torch, then compressed-tensors) was longer than the whole stream, so
# the warm CLI waited for it: the child imports only the config models it needs
# (Note [lean import] in mpack/convert/ctlean.py).

# Note [verdict cache]: even lean, the child imports torch (compressed-tensors' models use it at
# class definition): seconds of CPU, and from a cold disk seconds of reads that the conversion's own
# reads wait behind (figures: docs/BENCHMARKS.md, sections 6.2 and 6.3). Its verdict is a function
# of bytes the parent can read in milliseconds: the config, the index and every shard's header (the
# check reads no tensor data), and of the code that judges them (compressed-tensors, pydantic and
# transformers by version, mpack's checking modules by content, the interpreter). So a good verdict
# is kept in mpack's cache (``verdicts``, :mod:`mpack.cache`) under the sha256 of all of that
# (:func:`verdict_key`), and a later check of the same bytes by the same code takes it from there
# instead of forking the child: compressed-tensors still parsed this config, once. Only good
# verdicts are kept (an error names paths and is cheap to reach again), and only when the key the
# child computes after its check equals the one the parent computed before it (a source edited
# meanwhile leaves nothing). An entry that does not read back as one is ignored, and one whose
# layers disagree with the headers is checked again (:meth:`SchemeCheck.agree`).
# ``MPACK_NO_VERDICT_CACHE=1`` turns the cache off.
# The key is no secret (anyone who can read the source can compute it), and a kept "ok" lets a
# checkpoint through that the check would refuse (and `verify --source` with it). So an entry
# counts only if nobody but us could have written it: Note [cache trust] in mpack/cache.py (the
# root, ``verdicts`` and the entry ours and not group- or other-writable, no symlink, a regular
# file under a size cap). Any other entry is ignored, the check runs, and ``mpack -v`` says so;
# a ``verdicts`` that breaks the rule is never written to.

#: Changes whenever an entry's meaning or the key's inputs change.
VERDICT_FORMAT = 1
#: The modules whose code judges a checkpoint (by content: a development tree keeps one version).
_JUDGES = ("checkpoint.py", "scheme_check.py", "ctlean.py")
#: The distributions whose code judges it (by version).
_JUDGE_DISTS = ("compressed-tensors", "pydantic", "transformers")


def verdict_cache_enabled() -> bool:
    return not env_flag("MPACK_NO_VERDICT_CACHE")


def verdict_key(root: str | os.PathLike) -> str | None:
    """The sha256 of everything the check's verdict on ``root`` depends on (Note [verdict
    cache]); None where something cannot be read as expected (the check then runs and says
    what)."""
    from importlib import metadata

    from mpack.sidecar import CONFIG_NAME, INDEX_NAME, read_header_bytes

    root = Path(root)
    h = hashlib.sha256(f"mpack verdict {VERDICT_FORMAT} {__version__} {sys.version}\0".encode())
    for dist in _JUDGE_DISTS:
        try:
            version = metadata.version(dist)
        except metadata.PackageNotFoundError:
            version = "-"
        h.update(f"{dist} {version}\0".encode())
    here = Path(__file__).parent
    try:
        for name in _JUDGES:
            _feed(h, name, (here / name).read_bytes())
        _feed(h, CONFIG_NAME, (root / CONFIG_NAME).read_bytes())
        index = root / INDEX_NAME
        _feed(h, INDEX_NAME, index.read_bytes() if index.is_file() else b"")
        for shard in sorted(root.glob("*.safetensors")):
            size, prefix, raw = read_header_bytes(shard)
            _feed(h, f"{shard.name} {size}", prefix + raw)
    except (OSError, MpackError):  # the check reads it too, and says what is wrong
        return None
    return h.hexdigest()


def _feed(h: Any, name: str, data: bytes) -> None:
    """One named input of the key, framed so that no two inputs run together."""
    h.update(f"{name}\0{len(data)}\0".encode())
    h.update(data)


def _entry_name(key: str) -> str:
    return f"{key}.json"


def cached_verdict(key: str) -> dict[str, tuple[str, int, int, bool]] | None:
    """The layers of a good verdict kept under ``key``, or None (missing, not one, or not to be
    trusted: Note [cache trust] in :mod:`mpack.cache`)."""
    raw = cache.read_entry(
        "verdicts", _entry_name(key), then="the quantization config is checked instead"
    )
    if raw is None:
        return None
    try:
        entry = parse_json(raw, _entry_name(key), "verdict")
        if entry.get("format") != VERDICT_FORMAT or entry.get("key") != key:
            return None
        layers = {}
        for module, (strategy, n, k, bias) in entry["layers"].items():
            if not (
                isinstance(strategy, str)
                and type(n) is int
                and type(k) is int
                and isinstance(bias, bool)
            ):
                return None
            layers[module] = (strategy, n, k, bias)
    except (MpackError, ValueError, TypeError, AttributeError, KeyError):
        return None
    return layers


def keep_verdict(key: str, layers: dict[str, tuple[str, int, int, bool]], root: Path) -> bool:
    """Keep a good verdict (best effort; False where the cache cannot be written)."""
    entry = {"format": VERDICT_FORMAT, "key": key, "source": str(root), "layers": layers}
    return cache.write_entry(
        "verdicts", _entry_name(key), json.dumps(entry, sort_keys=True).encode()
    )


class SchemeCheck:
    """The full validation of ``root`` (scheme included), possibly running in a child process.

    :meth:`result` returns ``{module: (strategy, n, k, has_bias)}`` or raises the check's
    ``MpackError``; :meth:`cancel` stops a child that is no longer needed. Where a child would
    run, a good verdict on the same bytes by the same code is taken from the cache instead
    (Note [verdict cache]; ``use_cache=False``, or ``MPACK_NO_VERDICT_CACHE=1``: never).
    """

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        background: bool | None = None,
        use_cache: bool | None = None,
    ) -> None:
        self.root = Path(root)
        self._verdict: tuple[str, Any] | None = None
        self._proc: Any = None
        self._conn: Any = None
        self._key: str | None = None
        #: The verdict came from the cache: no child ran.
        self.cached = False
        if background is None:
            background = (
                "compressed_tensors" not in sys.modules
                and hasattr(os, "fork")
                and os.environ.get("MPACK_SCHEME_CHECK", "") != "inline"
            )
        if background and (verdict_cache_enabled() if use_cache is None else use_cache):
            self._key = verdict_key(self.root)
            layers = cached_verdict(self._key) if self._key else None
            if layers is not None:
                self._verdict, self.cached, background = ("ok", layers), True, False
        if background:
            import multiprocessing

            ctx = multiprocessing.get_context("fork")
            recv, send = ctx.Pipe(duplex=False)
            self._proc = ctx.Process(
                target=_scheme_child,
                args=(str(self.root), send),
                name="mpack-scheme-check",
                daemon=True,
            )
            self._proc.start()
            send.close()
            self._conn = recv

    def _settle(self, verdict: tuple[str, Any], child_key: str | None) -> None:
        """Take the child's verdict; keep a good one only if the key the child computed after
        its check is the one computed before it (the bytes did not change in between)."""
        self._verdict = verdict
        if verdict[0] == "ok" and self._key is not None and child_key == self._key:
            keep_verdict(self._key, verdict[1], self.root)

    @property
    def in_child(self) -> bool:
        """A child process reaches the verdict."""
        return self._proc is not None

    @property
    def deferred(self) -> bool:
        """The verdict comes from a child or the cache, not from the caller's own parse: the
        caller opens the checkpoint without compressed-tensors and calls :meth:`agree`."""
        return self.in_child or self.cached

    def result(self) -> dict[str, tuple[str, int, int, bool]]:
        if self._verdict is None:
            if self._proc is None:
                self._verdict = _scheme_verdict(self.root)
            else:
                try:
                    self._settle(*self._conn.recv())
                except (EOFError, OSError):
                    self._proc.join()
                    self._verdict = (
                        "crash",
                        f"the check process died (exit code {self._proc.exitcode})",
                    )
                finally:
                    self._conn.close()
                self._proc.join()
        kind, payload = self._verdict
        if kind == "ok":
            return payload
        if kind == "error":
            module, qualname, message, hint = payload
            import importlib

            cls = getattr(importlib.import_module(module), qualname, None)
            if not (isinstance(cls, type) and issubclass(cls, MpackError)):
                cls = MpackError
            raise cls(message, hint=hint)
        raise MpackError(f"validating {self.root} failed unexpectedly: {payload}")

    @contextlib.contextmanager
    def errors_first(self) -> Iterator[None]:
        """An input error raised in the block gives way to this check's own error, if the check
        (in a child) finds one: the error an inline check would have raised first."""
        try:
            yield
        except MpackError:
            if self.deferred:
                self.result()
            raise

    def agree(self, ck: Checkpoint) -> None:
        """The verdict (raises the check's error); its layers must be those planned from the
        headers of ``ck``. Inline, the first :func:`open_checkpoint` already ran the full check."""
        if not self.deferred:
            return
        from mpack.convert.checkpoint import layer_summary

        layers, planned = self.result(), layer_summary(ck.layers)
        if layers != planned and self.cached:  # a damaged entry: the check itself decides
            self.cached, self._verdict = False, _scheme_verdict(self.root)
            layers = self.result()
            if self._key is not None:
                keep_verdict(self._key, layers, self.root)
        if layers != planned:
            diff = sorted(m for m in set(layers) | set(planned) if layers.get(m) != planned.get(m))
            raise MpackError(
                f"{ck.root}: the quantization config and the tensor headers disagree on {diff[:3]}",
                hint="run again with MPACK_SCHEME_CHECK=inline, and please report this",
            )

    def cancel(self) -> None:
        if self._proc is not None and self._verdict is None:
            if self._proc.is_alive():
                self._proc.kill()
            self._proc.join()
            self._conn.close()
            self._verdict = ("crash", "cancelled")


def _scheme_verdict(root: Path) -> tuple[str, Any]:
    from mpack.convert.checkpoint import find_layers, layer_summary, open_checkpoint

    try:
        ck = open_checkpoint(root)
        return "ok", layer_summary(find_layers(ck))
    except MpackError as e:
        return "error", (type(e).__module__, type(e).__qualname__, e.message, e.hint)
    except Exception as e:  # a bug: reported by the parent as an internal error
        return "crash", f"{type(e).__name__}: {e}"


def child_verdict(root: Path, *, lean: bool = True) -> tuple[str, Any]:
    """The verdict as the child reaches it: first with compressed-tensors imported lean (Note
    [lean import] in :mod:`mpack.convert.ctlean`), then, unless that said ``ok``, again with the
    full import, whose verdict is the one reported. ``lean=False`` (or ``MPACK_CT_IMPORT=full``):
    the full import only."""
    from mpack.convert import ctlean

    if lean and os.environ.get("MPACK_CT_IMPORT", "") != "full" and ctlean.install():
        try:
            verdict = _scheme_verdict(root)
        finally:
            ctlean.uninstall()
        if verdict[0] == "ok":
            return verdict
    return _scheme_verdict(root)


def _scheme_child(root: str, conn: Any) -> None:
    """The child: its verdict, and for a good one the key of what it judged (read after the
    check, so that a source changed meanwhile is not kept under the earlier key)."""
    try:
        verdict = child_verdict(Path(root))
        conn.send((verdict, verdict_key(root) if verdict[0] == "ok" else None))
    finally:
        conn.close()
