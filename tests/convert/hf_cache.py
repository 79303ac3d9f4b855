"""A Hugging Face cache on disk, laid out as huggingface_hub 2.x leaves a finished download.

``models--org--name/{blobs,refs,snapshots,trees}`` (see huggingface_hub's
``_snapshot_download.py`` and ``_tree_cache.py``). With ``HF_HUB_CACHE`` pointing at it and
``HF_HUB_OFFLINE=1``, ``snapshot_download`` resolves refs and snapshots exactly as it does for a
model downloaded earlier, so a test can name a Hub repo without the network. Used by
tests/convert/test_hub_source.py, tests/test_first_contact.py and tests/test_doc_examples.py.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any


def git_blob_sha1(data: bytes) -> str:
    """The git object id of a file (how the Hub names the blob of a non-LFS file)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def add_repo(
    cache: Path,
    repo: str,
    files: dict[str, bytes],
    commit: str,
    refs: list[str],
    *,
    missing: tuple[str, ...] = (),
) -> Path:
    """Lay out ``repo`` at ``commit`` in an HF cache as a finished download would.

    ``blobs/<id>``: LFS files (``*.safetensors``) are named by their sha256, the others by their
    git blob sha1. ``snapshots/<commit>/<file>``: relative symlinks to the blobs (files in
    ``missing`` are left out). ``refs/<ref>``: the commit, no newline.
    ``trees/<commit>.json``: the cached tree listing (plus a README.md that the allow-patterns
    of a conversion skip). Returns the snapshot directory.
    """
    root = cache / ("models--" + repo.replace("/", "--"))
    snap = root / "snapshots" / commit
    (root / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    (root / "refs").mkdir()
    tree: dict[str, Any] = {"README.md": {"size": 11, "blob_id": git_blob_sha1(b"# tiny\n...")}}
    for name, data in files.items():
        lfs = name.endswith(".safetensors")
        blob = hashlib.sha256(data).hexdigest() if lfs else git_blob_sha1(data)
        (root / "blobs" / blob).write_bytes(data)
        if name not in missing:  # a name in a folder ("tp2-w8a16-bfloat16/mpack.json") too
            (snap / name).parent.mkdir(parents=True, exist_ok=True)
            os.symlink(os.path.relpath(root / "blobs" / blob, (snap / name).parent), snap / name)
        tree[name] = {"size": len(data), "blob_id": git_blob_sha1(data)}
        if lfs:
            tree[name].update(lfs_sha256=blob, lfs_size=len(data))
    for ref in refs:
        (root / "refs" / ref).write_text(commit)
    (root / "trees").mkdir()
    (root / "trees" / f"{commit}.json").write_text(
        json.dumps({"format_version": 1, "files": tree}, indent=1)
    )
    return snap
