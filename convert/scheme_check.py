"""The full validation of a checkpoint (compressed-tensors' own parse of its config included),
overlapped with the conversion in a forked child (Note [scheme check in a child]).

This module imports neither torch nor compressed-tensors, so that ``mpack convert`` can fork the
child before it imports torch itself: the child's imports then overlap the parent's.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mpack.errors import MpackError

if TYPE_CHECKING:
    from mpack.convert.checkpoint import Checkpoint

# Note [scheme check in a child]: compressed-tensors imports transformers (and with it
# torch.distributed, sympy, torch._dynamo): 2.4 s on a laptop-class core, 8.5 s on the H200 host,
# longer than streaming an 8B model. Nothing in the plan needs it: which tensors form a
# quantized linear, and its strategy, follow from the safetensors headers (an F8_E4M3 weight
# with a weight_scale of one value or N values). The config is the cross-check. So `mpack
# convert` plans from the headers (``open_checkpoint(scheme=False)``) and runs the full check
# (``open_checkpoint`` + ``find_layers``, with compressed-tensors' own models) in a forked child
# that imports it on another core while the parent streams. The parent waits for the child's
# verdict before anything becomes visible: a failed check removes the work directory, and its
# error is the same, word for word, as the inline check's. Where compressed-tensors is already
# imported (a library caller, the tests) or fork is unavailable, the check runs inline. The CLI
# starts the child for a local source first thing, before it imports torch (see mpack.cli).
# Even in a child, the full import (torch, then 8.3 s of compressed-tensors on the H200 host) was
# longer than the whole stream, so the warm CLI waited for it: the child imports only the config
# models it needs (Note [lean import] in mpack/convert/ctlean.py).


class SchemeCheck:
    """The full validation of ``root`` (scheme included), possibly running in a child process.

    :meth:`result` returns ``{module: (strategy, n, k, has_bias)}`` or raises the check's
    ``MpackError``; :meth:`cancel` stops a child that is no longer needed.
    """

    def __init__(self, root: str | os.PathLike, *, background: bool | None = None) -> None:
        import sys

        self.root = Path(root)
        self._verdict: tuple[str, Any] | None = None
        self._proc: Any = None
        self._conn: Any = None
        if background is None:
            background = (
                "compressed_tensors" not in sys.modules
                and hasattr(os, "fork")
                and os.environ.get("MPACK_SCHEME_CHECK", "") != "inline"
            )
        if background:
            import multiprocessing

            ctx = multiprocessing.get_context("fork")
            recv, send = ctx.Pipe(duplex=False)
            self._proc = ctx.Process(
                target=_scheme_child, args=(str(self.root), send), name="mpack-scheme-check",
                daemon=True,
            )  # fmt: skip
            self._proc.start()
            send.close()
            self._conn = recv

    @property
    def in_child(self) -> bool:
        return self._proc is not None

    def result(self) -> dict[str, tuple[str, int, int, bool]]:
        if self._verdict is None:
            if self._proc is None:
                self._verdict = _scheme_verdict(self.root)
            else:
                try:
                    self._verdict = self._conn.recv()
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
            if self.in_child:
                self.result()
            raise

    def agree(self, ck: Checkpoint) -> None:
        """The verdict (raises the check's error); its layers must be those planned from the
        headers of ``ck``. Inline, the first :func:`open_checkpoint` already ran the full check."""
        if not self.in_child:
            return
        from mpack.convert.checkpoint import layer_summary

        layers, planned = self.result(), layer_summary(ck.layers)
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
    try:
        conn.send(child_verdict(Path(root)))
    finally:
        conn.close()
