"""mpack's per-user cache: things that cost time to make and are safe to make again.

Two kinds live here, each in its own folder under ``$MPACK_CACHE_DIR`` (default
``$XDG_CACHE_HOME/mpack``, else ``~/.cache/mpack``):

- ``kernels``: the NVRTC builds of the fused repack kernel (:mod:`mpack.convert.cuda_repack`);
- ``verdicts``: the good verdicts of compressed-tensors' check of a source's quantization
  config (Note [verdict cache] in :mod:`mpack.convert.scheme_check`).

Everything here is best effort: an entry is written whole or not at all (a temporary file
renamed into place), a cache that cannot be read or written is skipped without a word, and
removing the folder at any time only costs the time to make its entries again.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["cache_dir", "get", "put"]


def cache_dir(kind: str) -> Path:
    """The folder of one kind of entry: ``$MPACK_CACHE_DIR/<kind>``, else
    ``$XDG_CACHE_HOME/mpack/<kind>``, else ``~/.cache/mpack/<kind>``."""
    root = os.environ.get("MPACK_CACHE_DIR")
    if not root:
        base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        root = str(Path(base) / "mpack")
    return Path(root) / kind


def get(path: Path) -> bytes | None:
    """The entry's bytes, or None where it is missing or cannot be read."""
    try:
        return path.read_bytes()
    except OSError:
        return None


def put(path: Path, data: bytes) -> bool:
    """Write an entry whole (a concurrent reader sees all of it or none); False where the cache
    cannot be written (the caller goes on without it)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError:
        return False
    return True
