"""Sidecars that are not what they claim (red-team report, issue 11, items 4-8, 13, 14; issue 24,
item 11, and the suite's own gaps: real device nodes, a flipped byte only a digest can see, a
manifest refused before it is parsed).

Every consumer (inspect, verify, serve, ``load()``, ``attach()``) must refuse, quickly and with
a clear ``MpackError`` (exit 2), a sidecar whose files are FIFOs, symlinks out of the directory,
oversized or deeply nested manifests, manifests with numbers out of range, headers with negative
or fractional shapes, rank files that hold other tensors than the manifest implies, or files the
manifest does not list. Real sidecars (written through mpack.sidecar), real files, real FIFOs,
real processes for the CLI.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import stat
import struct
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import mpack.fsutil
import mpack.sidecar
from mpack.errors import (
    CorruptFileError,
    EnvironmentFailure,
    InputError,
    VerificationError,
    exit_code_for,
)
from mpack.iokit import chunk_digests, sha256_file
from mpack.runtime import attach, load
from mpack.runtime.allocation import plan_rank
from mpack.sidecar import (
    MANIFEST_NAME,
    MAX_MANIFEST,
    check_files,
    load_manifest,
    manifest_bytes,
    rank_file_name,
    read_file_map,
)
from tests.conftest import flip_byte
from tests.convert.helpers import cli
from tests.runtime.sidecar_factory import make_sidecar

HANG_S = 20  # a consumer that has not returned by then is hung (a FIFO open blocks forever)
mpack_cli = functools.partial(cli, timeout=HANG_S * 3)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    return make_sidecar(tmp_path_factory.mktemp("hostile") / "sidecar", tp=2, layers=1)


@pytest.fixture
def sc(pristine, tmp_path) -> Path:
    """A fresh, valid copy of a TP-2 sidecar for each test to damage."""
    return Path(shutil.copytree(pristine, tmp_path / "sc"))


def finishes(fn: Callable[[], Any], unblock: Path | None = None) -> BaseException | None:
    """Run ``fn`` on a thread; its exception (None if it returned). Fails the test if it is still
    running after ``HANG_S`` (and then opens the FIFO ``unblock`` for writing to free it)."""
    box: list[BaseException | None] = [None]

    def run() -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box[0] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(HANG_S)
    if t.is_alive():
        if unblock is not None:
            os.close(os.open(unblock, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail(f"{fn} hung for {HANG_S} s")
    return box[0]


def rewrite_manifest(sc: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    m = json.loads((sc / MANIFEST_NAME).read_text())
    edit(m)
    (sc / MANIFEST_NAME).write_bytes(manifest_bytes(m))


def resign(sc: Path, name: str) -> None:
    """Make the manifest's size and digest of ``name`` match its bytes (a forger's move)."""

    def edit(m: dict[str, Any]) -> None:
        for f in m["files"]:
            if f["name"] == name:
                f["size"] = (sc / name).stat().st_size
                f["sha256"] = sha256_file(sc / name)
                f.pop("chunks", None)

    rewrite_manifest(sc, edit)


def rewrite_header(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Edit a safetensors header in place of the old one (data bytes unchanged)."""
    data = path.read_bytes()
    (hlen,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + hlen])
    edit(header)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * ((-(8 + len(raw))) % 64)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + hlen :])


RANK0 = rank_file_name(0, 2)


def _consumers(sc: Path) -> dict[str, Callable[[], Any]]:
    return {
        "load_manifest": lambda: load_manifest(sc),
        "check_files": lambda: check_files(sc, load_manifest(sc)[0]) or None,
        "plan_rank": lambda: plan_rank(sc, 0),
        "load": lambda: load(sc, rank=0),
        "attach": lambda: attach(sc, rank=0),
    }


# --- 4. FIFOs and special files ------------------------------------------------------------


def test_a_fifo_manifest_is_refused_by_every_consumer_without_hanging(sc):
    (sc / MANIFEST_NAME).unlink()
    os.mkfifo(sc / MANIFEST_NAME)
    for what, fn in _consumers(sc).items():
        err = finishes(fn, unblock=sc / MANIFEST_NAME)
        assert isinstance(err, InputError), (what, err)
        assert "FIFO" in str(err) and MANIFEST_NAME in str(err), (what, err)
    for cmd in ("inspect", "verify", "serve"):
        r = mpack_cli(cmd, sc)
        assert r.returncode == 2 and "FIFO" in r.stderr, (cmd, r.stderr)


def test_a_fifo_rank_file_is_refused_without_hanging(sc):
    (sc / RANK0).unlink()
    os.mkfifo(sc / RANK0)
    for what in ("plan_rank", "load"):
        err = finishes(_consumers(sc)[what], unblock=sc / RANK0)
        assert isinstance(err, InputError) and "FIFO" in str(err), (what, err)
    problems = finishes(lambda: _raise_problems(sc), unblock=sc / RANK0)
    assert problems is not None and "FIFO" in str(problems)
    for cmd in ("verify", "serve"):
        r = mpack_cli(cmd, sc)
        assert r.returncode == 2 and "FIFO" in r.stderr, (cmd, r.stderr)


def _raise_problems(sc: Path) -> None:
    problems = check_files(sc, load_manifest(sc)[0])
    if problems:
        raise InputError("; ".join(problems))


def plant_dev_zero(path: Path) -> None:
    """A real character device node at ``path``: /dev/zero's (major 1, minor 5), which never
    ends. Needs CAP_MKNOD (root)."""
    path.unlink()
    try:
        os.mknod(path, stat.S_IFCHR | 0o644, os.makedev(1, 5))
    except PermissionError:
        pytest.skip("creating a device node needs root (CAP_MKNOD)")
    assert stat.S_ISCHR(os.lstat(path).st_mode)


def test_a_device_node_as_a_rank_file_is_refused(sc):
    # without the regular-file check it would be read as a 0-byte file (st_size of a device):
    # "too short", not "a character device"
    plant_dev_zero(sc / RANK0)
    for what in ("plan_rank", "load"):
        err = finishes(_consumers(sc)[what])
        assert isinstance(err, InputError) and "is a character device" in str(err), (what, err)
    assert any(
        RANK0 in p and "character device" in p for p in check_files(sc, load_manifest(sc)[0])
    )
    for cmd in ("verify", "serve"):
        r = mpack_cli(cmd, sc)
        assert r.returncode == 2 and "is a character device" in r.stderr, (cmd, r.stderr)


def test_a_symlink_to_a_device_as_a_rank_file_is_refused(sc):
    (sc / RANK0).unlink()
    os.symlink("/dev/zero", sc / RANK0)  # a link: refused as such, never read
    err = finishes(lambda: plan_rank(sc, 0))
    assert isinstance(err, InputError) and "symbolic link" in str(err)


# --- 5. symlinks out of the sidecar ----------------------------------------------------------


def test_a_symlink_out_of_the_sidecar_is_never_read(sc, tmp_path):
    secret = tmp_path / "secret"
    secret.write_bytes(b"SECRET!!" + b"x" * 100)
    leaked = str(struct.unpack("<Q", b"SECRET!!")[0])
    (sc / RANK0).unlink()
    os.symlink(secret, sc / RANK0)
    for what in ("plan_rank", "load"):
        err = finishes(_consumers(sc)[what])
        assert isinstance(err, InputError) and "symbolic link" in str(err), (what, err)
        assert leaked not in str(err)
    for cmd in ("verify", "serve"):
        r = mpack_cli(cmd, sc)
        assert r.returncode == 2 and "symbolic link" in r.stderr, (cmd, r.stderr)
        assert leaked not in r.stderr and "SECRET" not in r.stderr


def test_a_symlinked_manifest_is_refused(sc, tmp_path):
    real = tmp_path / "elsewhere.json"
    shutil.move(sc / MANIFEST_NAME, real)
    os.symlink(real, sc / MANIFEST_NAME)
    with pytest.raises(InputError, match="symbolic link"):
        load_manifest(sc)


def test_the_sidecar_directory_itself_may_be_a_symlink(sc, tmp_path):
    link = tmp_path / "link-to-sc"
    os.symlink(sc, link)
    with load(link, rank=1) as w:
        assert w.digest == load_manifest(sc)[1]


# --- 6. manifest size and numbers -------------------------------------------------------------


def test_a_symlink_to_dev_zero_as_manifest_is_refused_at_once(sc):
    (sc / MANIFEST_NAME).unlink()
    os.symlink("/dev/zero", sc / MANIFEST_NAME)
    err = finishes(lambda: load_manifest(sc))
    assert isinstance(err, InputError) and "symbolic link" in str(err)


def test_a_device_node_as_manifest_is_refused_by_every_consumer(sc):
    # without the regular-file check, the cap would refuse it after reading 32 MiB of zeros:
    # "more than the ... bytes", not "a character device"
    plant_dev_zero(sc / MANIFEST_NAME)
    for what, fn in _consumers(sc).items():
        err = finishes(fn)
        assert isinstance(err, InputError), (what, err)
        assert "is a character device" in str(err) and MANIFEST_NAME in str(err), (what, err)
    for cmd in ("inspect", "verify", "serve"):
        r = mpack_cli(cmd, sc)
        assert r.returncode == 2 and "is a character device" in r.stderr, (cmd, r.stderr)


class ParseSpy:
    """``mpack.fsutil``'s ``json`` (the one parse of JSON from outside, ``parse_json``), with
    ``loads`` recording the size of what it parses."""

    def __init__(self) -> None:
        self.parsed: list[int] = []

    def loads(self, s: str | bytes) -> Any:
        self.parsed.append(len(s))
        return json.loads(s)

    def __getattr__(self, name: str) -> Any:
        return getattr(json, name)


def test_an_oversized_manifest_is_refused_before_it_is_parsed(sc, monkeypatch):
    spy = ParseSpy()
    monkeypatch.setattr(mpack.fsutil, "json", spy)
    load_manifest(sc)
    assert spy.parsed  # the spy sees a manifest parsed
    spy.parsed.clear()
    m = json.loads((sc / MANIFEST_NAME).read_text())
    m["padding"] = "x" * (MAX_MANIFEST + 1)
    (sc / MANIFEST_NAME).write_text(json.dumps(m))
    with pytest.raises(InputError, match=f"more than the {MAX_MANIFEST}"):
        load_manifest(sc)
    assert spy.parsed == []  # refused on its size alone


@pytest.mark.parametrize(
    "value, why",
    [
        (10**18, "not an integer in 1..1024"),
        (0, "not an integer in 1..1024"),
        (-1, "not an integer in 1..1024"),
        (True, "not an integer"),
        (2.0, "not an integer"),
    ],
)
def test_tp_size_out_of_range_is_refused_before_use(sc, value, why):
    rewrite_manifest(sc, lambda m: m["target"].__setitem__("tp_size", value))
    err = finishes(lambda: load_manifest(sc))
    assert isinstance(err, CorruptFileError) and why in str(err), err
    r = mpack_cli("verify", sc)
    assert r.returncode == 2 and "tp_size" in r.stderr, r.stderr


def test_deeply_nested_json_is_a_corrupt_manifest(sc):
    (sc / MANIFEST_NAME).write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(CorruptFileError, match="nested too deeply"):
        load_manifest(sc)
    r = mpack_cli("inspect", sc)
    assert r.returncode == 2 and "nested too deeply" in r.stderr, r.stderr


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda m: m["files"][0].__setitem__("size", -5), "malformed files entry"),
        (lambda m: m["files"][0].__setitem__("size", 2**60), "malformed files entry"),
        (lambda m: m["files"][0].__setitem__("sha256", "zz"), "malformed files entry"),
        (lambda m: m["files"].append(dict(m["files"][0])), "listed twice"),
        (lambda m: m["target"].__setitem__("profile", "w4a16"), "target profile"),
        (lambda m: m["target"].__setitem__("act_dtype", "float32"), "target act_dtype"),
        (
            lambda m: m["layers"].__setitem__(
                "x", {"n": 10**12, "k": 1, "np": 1, "kp": 1, "bias": False}
            ),
            "layer 'x' is malformed",
        ),
    ],
    ids=[
        "negative-size",
        "huge-size",
        "bad-digest",
        "duplicate-file",
        "profile",
        "act-dtype",
        "huge-layer",
    ],
)
def test_every_number_and_name_is_bounded(sc, edit, match):
    rewrite_manifest(sc, edit)
    with pytest.raises(CorruptFileError, match=match):
        load_manifest(sc)


# --- issue 24, item 11: the manifest's encoding, its digests, its source ---------------------


@pytest.mark.parametrize(
    "encoding, match",
    [
        ("utf-16", "UTF-16 byte order mark"),
        ("utf-16-le", "NUL bytes"),
        ("utf-32", "UTF-32 byte order mark"),
        ("utf-8-sig", "UTF-8 byte order mark"),
    ],
)
def test_a_manifest_that_is_not_plain_utf8_is_refused(sc, encoding, match):
    text = (sc / MANIFEST_NAME).read_text()
    (sc / MANIFEST_NAME).write_bytes(text.encode(encoding))  # the same JSON, other bytes
    with pytest.raises(CorruptFileError, match=match):
        load_manifest(sc)
    r = mpack_cli("inspect", sc)
    assert r.returncode == 2 and match in r.stderr and "UTF-8" in r.stderr, r.stderr


def test_a_manifest_with_a_byte_that_is_not_utf8_is_refused(sc):
    raw = (sc / MANIFEST_NAME).read_bytes().replace(b'"test/random"', b'"test/r\xe9ndom"')
    (sc / MANIFEST_NAME).write_bytes(raw)
    at = raw.index(b"\xe9")
    with pytest.raises(CorruptFileError, match=f"not UTF-8 \\(byte 0xe9 at offset {at}\\)"):
        load_manifest(sc)


@pytest.mark.parametrize("where", ["files", "layers", "created_by"])
def test_a_lone_surrogate_in_the_manifest_is_bad_input(sc, where):
    text = (sc / MANIFEST_NAME).read_text()
    if where == "files":  # the name of a listed file (was UnicodeEncodeError, exit 1)
        text = text.replace('"name": "common.safetensors"', '"name": "common\\ud800.safetensors"')
        (sc / "common.safetensors").unlink()
    elif where == "layers":
        text = text.replace('"model.layers.0.mlp.down_proj"', '"model.layers.0.\\udc80"')
    else:
        text = text.replace('"created_by": "mpack', '"created_by": "\\udfff mpack')
    (sc / MANIFEST_NAME).write_text(text)
    with pytest.raises(CorruptFileError, match="lone surrogate") as e:
        load_manifest(sc)
    assert where in str(e.value)
    for cmd in ("inspect", "verify", "serve"):
        r = mpack_cli(cmd, sc)
        assert r.returncode == 2 and "lone surrogate" in r.stderr, (cmd, r.stderr)


def test_a_pair_of_surrogates_is_one_character_and_accepted(sc):
    text = (sc / MANIFEST_NAME).read_text()
    (sc / MANIFEST_NAME).write_text(
        text.replace('"created_by": "mpack', '"created_by": "\\ud83d\\ude00')
    )
    assert load_manifest(sc)[0]["created_by"].startswith("\U0001f600")


@pytest.mark.parametrize("name", ["bell\x07.json", "rtl\u202e.json", "nl\n.json", "x" * 256])
def test_a_file_name_that_is_not_printable_or_too_long_is_refused(sc, name):
    def edit(m: dict[str, Any]) -> None:
        m["files"].append({"name": name, "size": 2, "sha256": OTHER_DIGEST})

    rewrite_manifest(sc, edit)
    with pytest.raises(CorruptFileError, match="is not a plain file name") as e:
        load_manifest(sc)
    assert not any(c in str(e.value) for c in "\x07\u202e\n"), e.value  # quoted, escaped
    r = mpack_cli("verify", sc)
    assert r.returncode == 2 and "is not a plain file name" in r.stderr, r.stderr


def _chunked(sc: Path, name: str, chunk: int, sha256: str | None) -> None:
    """Give ``name``'s files entry true ``chunk``-byte digests, and ``sha256`` beside them."""

    def edit(m: dict[str, Any]) -> None:
        for f in m["files"]:
            if f["name"] == name:
                f["chunks"] = {"bytes": chunk, "sha256": chunk_digests(sc / name, chunk)}
                f["sha256"] = sha256

    rewrite_manifest(sc, edit)


OTHER_DIGEST = "0" * 64


def test_a_whole_file_sha256_beside_one_chunk_digest_must_agree(sc):
    common = "common.safetensors"
    _chunked(sc, common, 1 << 26, sha256_file(sc / common))
    load_manifest(sc)  # both digests true: fine
    _chunked(sc, common, 1 << 26, OTHER_DIGEST)  # the chunk is true; the whole-file one is not
    with pytest.raises(CorruptFileError, match="and its one chunk digest .* differ"):
        load_manifest(sc)
    for cmd in ("verify", "serve"):
        r = mpack_cli(cmd, sc)
        assert r.returncode == 2 and "differ" in r.stderr and common in r.stderr, (cmd, r.stderr)


def test_a_whole_file_sha256_beside_several_chunk_digests_is_checked_by_verify(sc):
    common = "common.safetensors"
    _chunked(sc, common, 4096, sha256_file(sc / common))
    assert check_files(sc, load_manifest(sc)[0]) == []
    _chunked(sc, common, 4096, OTHER_DIGEST)  # every chunk digest is true
    m = load_manifest(sc)[0]
    for elsewhere in ((), (common,)):  # hashed here, or chunks streamed by verify --source
        problems = check_files(sc, m, hashed_elsewhere=elsewhere)
        assert problems == [
            f"{common}: sha256 of the whole file is {sha256_file(sc / common)[:16]}..., "
            f"manifest says {OTHER_DIGEST[:16]}..."
        ], elsewhere
    r = mpack_cli("verify", sc)
    assert r.returncode == 2 and "sha256 of the whole file" in r.stderr, r.stderr


@pytest.mark.parametrize(
    "files, match",
    [
        ("x", "source files is 'x', not a list"),
        ({"a": 1}, "not a list"),
        (["x"], "malformed source files entry 'x'"),
        ([{"name": "../etc/passwd", "size": 1, "sha256": OTHER_DIGEST}], "malformed source files"),
        ([{"name": "/etc/passwd", "size": 1, "sha256": OTHER_DIGEST}], "malformed source files"),
        ([{"name": "a\x1b.json", "size": 1, "sha256": OTHER_DIGEST}], "malformed source files"),
        ([{"name": "a.json", "size": "1", "sha256": OTHER_DIGEST}], "malformed source files"),
        (
            [
                {
                    "name": "a.json",
                    "size": 1,
                    "sha256": OTHER_DIGEST,
                    "chunks": {"bytes": 64, "sha256": [OTHER_DIGEST]},
                }
            ],
            "not both",
        ),
    ],
    ids=["string", "dict", "string-entry", "dotdot", "absolute", "control", "size", "both"],
)
def test_source_files_of_the_wrong_type_are_bad_input(sc, files, match):
    rewrite_manifest(sc, lambda m: m["source"].__setitem__("files", files))
    with pytest.raises(CorruptFileError, match=match):
        load_manifest(sc)


def test_verify_refuses_source_files_that_are_a_string_with_exit_2(converted, tmp_path):
    ck, pristine_sc = converted
    sc = Path(shutil.copytree(pristine_sc, tmp_path / "sc"))
    rewrite_manifest(sc, lambda m: m["source"].__setitem__("files", "x"))
    # the recorded source is here, so verify would re-derive and read source.files (was exit 1,
    # TypeError)
    for args in ((), ("--source", ck)):
        r = mpack_cli("verify", sc, *args)
        assert r.returncode == 2, r.stderr
        assert "source files is 'x'" in r.stderr and "internal error" not in r.stderr


# --- 7. loading is as strict as verifying ----------------------------------------------------


@pytest.mark.parametrize(
    "how",
    ["negative-dims", "float-offsets", "float-dims"],
)
def test_a_resigned_header_with_bad_numbers_is_refused_by_serve_and_load(sc, how):
    def edit(h: dict[str, Any]) -> None:
        name = next(k for k, v in h.items() if k != "__metadata__" and len(v["shape"]) == 2)
        e = h[name]
        if how == "negative-dims":  # the product, and so the byte count, is unchanged
            e["shape"] = [-e["shape"][0], -e["shape"][1]]
        elif how == "float-offsets":
            e["data_offsets"] = [float(x) for x in e["data_offsets"]]
        else:
            e["shape"] = [float(d) for d in e["shape"]]

    rewrite_header(sc / RANK0, edit)
    resign(sc, RANK0)
    with pytest.raises(CorruptFileError, match="malformed header entry"):
        read_file_map(sc / RANK0)
    with pytest.raises(CorruptFileError, match="malformed header entry"):
        load(sc, rank=0)
    r = mpack_cli("serve", sc, "--device", "cpu")
    assert r.returncode == 2 and "READY" not in r.stdout, (r.stdout, r.stderr)


def test_a_rank_file_with_other_tensors_than_the_layers_imply_is_refused_on_load(sc):
    def drop_a_layer(m: dict[str, Any]) -> None:
        del m["layers"][sorted(m["layers"])[0]]

    rewrite_manifest(sc, drop_a_layer)
    with pytest.raises(CorruptFileError, match="unexpected tensor"):
        load(sc, rank=0)
    with pytest.raises(CorruptFileError, match="unexpected tensor"):
        plan_rank(sc, 1)
    r = mpack_cli("serve", sc, "--device", "cpu")
    assert r.returncode == 2 and "unexpected tensor" in r.stderr and "READY" not in r.stdout


# --- 8. verify checks every file the target implies, and nothing else -------------------------


def test_verify_and_load_fail_a_rank_file_with_one_flipped_data_byte_on_its_digest(sc):
    # the last byte is tensor data: the header, the tensor names and shapes and the size all
    # still match, so only the digest check can notice
    flip_byte(sc / RANK0, (sc / RANK0).stat().st_size - 1)
    assert read_file_map(sc / RANK0).size == (sc / RANK0).stat().st_size
    want = load_manifest(sc)[0]
    (entry,) = [f for f in want["files"] if f["name"] == RANK0]
    r = mpack_cli("verify", sc)
    assert r.returncode == 2, r.stderr
    assert f"{RANK0}: sha256 " in r.stderr and f"manifest says {entry['sha256'][:16]}..." in (
        r.stderr
    )
    with pytest.raises(VerificationError, match="sha256"):
        load(sc, rank=0)


def test_verify_with_the_source_fails_a_flipped_byte_on_its_chunk_digest(converted, tmp_path):
    ck, pristine_sc = converted
    sc = Path(shutil.copytree(pristine_sc, tmp_path / "sc"))
    rank = sc / rank_file_name(0, 1)
    flip_byte(rank, rank.stat().st_size - 1)
    r = mpack_cli("verify", sc, "--source", ck)
    assert r.returncode == 2, r.stderr
    # the streamed check's digest finding, not the comparison's (which is then left out)
    assert f"{rank.name}: sha256 of bytes 0..{rank.stat().st_size} is " in r.stderr, r.stderr
    assert "manifest says" in r.stderr


def test_verify_fails_a_corrupted_rank_file_whose_entry_was_removed(sc):
    flip_byte(sc / RANK0, (sc / RANK0).stat().st_size - 1)
    rewrite_manifest(
        sc, lambda m: m.__setitem__("files", [f for f in m["files"] if f["name"] != RANK0])
    )
    r = mpack_cli("verify", sc)
    assert r.returncode == 2 and RANK0 in r.stderr and "do not list" in r.stderr, r.stderr


def test_verify_reports_files_the_manifest_does_not_list(sc):
    (sc / "extra.bin").write_bytes(b"surprise")
    r = mpack_cli("verify", sc)
    assert r.returncode == 2 and "extra.bin: not listed" in r.stderr, r.stderr


def test_verify_reports_an_unlisted_common_file(sc):
    rewrite_manifest(
        sc,
        lambda m: m.__setitem__(
            "files", [f for f in m["files"] if f["name"] != "common.safetensors"]
        ),
    )
    r = mpack_cli("verify", sc)
    assert r.returncode == 2 and "common.safetensors: not listed" in r.stderr, r.stderr


# --- 13. bad input is exit 2, never an internal error -----------------------------------------


@pytest.mark.parametrize("cmd", ["inspect", "verify", "serve", "status"])
def test_a_file_where_the_sidecar_directory_belongs(sc, cmd):
    r = mpack_cli(cmd, sc / MANIFEST_NAME)
    assert r.returncode == 2, r.stderr
    assert "not a sidecar directory" in r.stderr and "internal error" not in r.stderr


def test_load_and_attach_on_a_file_raise_input_error(sc):
    for fn in (load, attach):
        with pytest.raises(InputError, match="not a sidecar directory"):
            fn(sc / RANK0)


def test_a_directory_where_a_file_belongs(sc):
    (sc / RANK0).unlink()
    (sc / RANK0).mkdir()
    with pytest.raises(InputError, match="is a directory"):
        load(sc, rank=0)
    r = mpack_cli("verify", sc)
    assert r.returncode == 2 and "is a directory" in r.stderr, r.stderr
    (sc / MANIFEST_NAME).unlink()
    (sc / MANIFEST_NAME).mkdir()
    r = mpack_cli("inspect", sc)
    assert r.returncode == 2 and "is a directory" in r.stderr, r.stderr


def test_permission_denied_is_an_environment_failure_with_its_own_exit_code(sc):
    os.chmod(sc / MANIFEST_NAME, 0)
    cmd = [sys.executable, "-m", "mpack.cli", "inspect", str(sc)]
    if os.geteuid() == 0:  # root reads anything: take away the capabilities that allow it
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("running as root without setpriv: cannot make a permission error")
        cmd = [setpriv, "--bounding-set", "-dac_override,-dac_read_search", *cmd]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert r.returncode == 3, r.stderr
    assert "Permission denied" in r.stderr and MANIFEST_NAME in r.stderr
    assert "internal error" not in r.stderr
    assert exit_code_for(PermissionError(13, "Permission denied")) == 3
    assert EnvironmentFailure.exit_code == 3


# --- 14. printed values are never markup -----------------------------------------------------


@pytest.mark.parametrize("name", ["out-x[/]y", "a[red]b[/red]c", "[bold]z"])
def test_markup_in_a_path_is_printed_verbatim(sc, tmp_path, name):
    odd = tmp_path / name
    shutil.copytree(sc, odd)
    for cmd in ("inspect", "verify"):
        r = mpack_cli(cmd, odd, env={"COLUMNS": "400"})
        assert r.returncode == 0, (cmd, r.stderr)
        assert name in r.stdout, (cmd, r.stdout)


@pytest.mark.parametrize("where", ["inspect", "verify", "targets", "error"])
def test_an_escape_in_a_path_is_never_printed_raw(sc, tmp_path, where):
    """A directory named with ESC [31m (round 2's finding): inspect, verify, the listing of a
    directory of targets and an error message show the path escaped (\\x1b), never the raw
    escape that would colour the terminal."""
    odd = tmp_path / "red\x1b[31mdir"
    shutil.copytree(sc, odd / "sc")
    # the directory above (no mpack.json) is a directory of one target (Note [target layout]);
    # --tp 4 names none of it: refused, naming the directory
    target = odd / "sc" if where in ("inspect", "verify") else odd
    extra = ["--tp", "4"] if where == "error" else []
    cmd = "verify" if where == "verify" else "inspect"
    r = mpack_cli(cmd, target, *extra, env={"COLUMNS": "400"})
    assert r.returncode == (2 if where == "error" else 0), r.stderr
    out = r.stderr if where == "error" else r.stdout
    assert "\x1b" not in r.stdout + r.stderr, (r.stdout, r.stderr)
    assert "red\\x1b[31mdir" in out, out


def test_a_deeply_nested_header_names_the_file(sc):
    raw = b"[" * 200_000 + b"]" * 200_000
    (sc / RANK0).write_bytes(struct.pack("<Q", len(raw)) + raw)
    with pytest.raises(CorruptFileError, match="malformed safetensors header .nested too deeply"):
        read_file_map(sc / RANK0)
    r = mpack_cli("serve", sc, "--device", "cpu")
    assert r.returncode == 2 and f"{sc / RANK0}: malformed" in r.stderr, r.stderr


def test_a_header_length_over_100_mb_is_refused_before_it_is_read(sc):
    """safetensors refuses a header length over 100 000 000 bytes, and so does mpack (FORMAT.md),
    whatever the file holds: a sparse file whose 8-byte length says one byte more."""
    for hlen, refused in ((mpack.sidecar.MAX_HEADER + 1, True), (mpack.sidecar.MAX_HEADER, False)):
        with open(sc / RANK0, "wb") as f:
            f.write(struct.pack("<Q", hlen))
            f.truncate(8 + hlen + 64)  # sparse: all zeros
        assert hlen == 100_000_001 if refused else hlen == 100_000_000
        with pytest.raises(CorruptFileError) as e:
            read_file_map(sc / RANK0)
        over = f"{sc / RANK0}: header length {hlen} is over the 100000000 bytes"
        assert (over in str(e.value)) is refused, e.value  # at the limit: read, not JSON
    with open(sc / RANK0, "wb") as f:
        f.write(struct.pack("<Q", mpack.sidecar.MAX_HEADER + 1))
        f.truncate(8 + mpack.sidecar.MAX_HEADER + 1 + 64)
    with pytest.raises(CorruptFileError, match="is over the 100000000 bytes"):
        load(sc, rank=0)


def test_a_manifest_without_layers_is_refused_by_every_consumer(sc):
    """``layers: {}`` (re-signed, schema-valid otherwise) is no sidecar: load, attach and serve
    must refuse it, not serve READY with nothing in it (FORMAT.md: minProperties 1)."""
    rewrite_manifest(sc, lambda m: m.__setitem__("layers", {}))
    for consume in _consumers(sc).values():
        with pytest.raises(CorruptFileError, match="lists no layers"):
            consume()
    r = cli("serve", str(sc), "--rank", "0", "--device", "cpu")
    assert r.returncode == 2 and "lists no layers" in r.stderr, r.stderr
