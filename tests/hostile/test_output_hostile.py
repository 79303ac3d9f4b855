"""Names that are not text for a terminal (issue 24, item 10).

A layer, tensor or file name comes from files anyone can write. Printed raw, an escape sequence
in it recolours or clears the user's terminal, a bidi override makes a message read backwards,
and a 10 MB name puts tens of MB on stderr. Every message and table quotes such names through
``mpack.errors.quote`` (Note [quoting untrusted text]): control and format characters escaped,
at most 200 characters and then the full length. ``--json`` stays faithful (JSON escapes
control characters itself). Real sidecars, real CLI processes.
"""

from __future__ import annotations

import functools
import json
import shutil
import struct
from pathlib import Path
from typing import Any

import pytest

from mpack import ui
from mpack.errors import CorruptFileError, quote
from mpack.iokit import sha256_file
from mpack.runtime import load
from mpack.sidecar import MANIFEST_NAME, manifest_bytes, rank_file_name
from tests.convert.helpers import cli
from tests.runtime.sidecar_factory import make_sidecar

mpack_cli = functools.partial(cli, timeout=120)

ESC_NAME = "model.layers.0.\x1b[31mred\x1b[0m\u202eevil\x85\x7f"
#: What no output meant for people may hold: C0 controls (ESC), DEL, C1, bidi overrides.
RAW = ("\x1b", "\x7f", "\x85", "\u202e", "\u2066")
OLD = "model.layers.0.self_attn.o_proj"
BIG = 10 * 1024 * 1024  # a 10 MB layer name


def raw_in(text: str) -> list[str]:
    return [c for c in RAW if c in text]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    return make_sidecar(tmp_path_factory.mktemp("output") / "sidecar", tp=1, layers=1)


@pytest.fixture
def sc(pristine, tmp_path) -> Path:
    return Path(shutil.copytree(pristine, tmp_path / "sc"))


def edit_manifest(sc: Path, edit) -> None:
    m = json.loads((sc / MANIFEST_NAME).read_text())
    edit(m)
    (sc / MANIFEST_NAME).write_bytes(manifest_bytes(m))


def rename_layer(sc: Path, new: str, *, in_rank_file: bool) -> None:
    """Rename layer ``OLD`` in the manifest (and, with ``in_rank_file``, its tensors in the rank
    file's header too, then re-sign: a consistent sidecar a forger could write)."""
    rank = sc / rank_file_name(0, 1)
    if in_rank_file:
        data = rank.read_bytes()
        (hlen,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + hlen])
        for k in [k for k in header if k.startswith(OLD + ".")]:
            header[new + k[len(OLD) :]] = header.pop(k)
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * ((-(8 + len(raw))) % 64)
        rank.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + hlen :])

    def edit(m: dict[str, Any]) -> None:
        m["layers"][new] = m["layers"].pop(OLD)
        for f in m["files"]:
            f["size"], f["sha256"] = (sc / f["name"]).stat().st_size, sha256_file(sc / f["name"])

    edit_manifest(sc, edit)


# --- the helper ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "char",
    [
        "\x00",
        "\x1b",
        "\x07",
        "\x7f",
        "\x85",
        "\x9b",
        "\u202e",
        "\u2066",
        "\u200b",
        "\u2028",
        "\ud800",
        "\udc80",
    ],
)
def test_quote_escapes_every_control_format_and_surrogate_character(char):
    q = quote(f"a{char}b")
    assert char not in q and q.isprintable() and q.isascii(), q
    assert q.startswith("'a\\") and q.endswith("b'"), q
    q.encode("utf-8")  # a lone surrogate would make every write of the message fail


def test_quote_keeps_ordinary_text_and_caps_long_values():
    assert quote("model.layers.0.mlp.down_proj") == "'model.layers.0.mlp.down_proj'"
    assert quote("héllo 中") == "'héllo 中'"
    q = quote("x" * BIG)
    assert q == "'" + "x" * 200 + f"'... ({BIG} characters)", q[-40:]
    assert quote("abcdef", limit=3) == "'abc'... (6 characters)"
    other = quote({"name": "\x1b[2J" * 1000})
    assert "\x1b" not in other and len(other) < 260 and other.endswith("characters)")


# --- the commands --------------------------------------------------------------------------------


def test_inspect_escapes_a_layer_name_and_json_keeps_it(sc):
    rename_layer(sc, ESC_NAME, in_rank_file=True)
    r = mpack_cli("inspect", sc, env={"COLUMNS": "400"})
    assert r.returncode == 0, r.stderr
    assert not raw_in(r.stdout), raw_in(r.stdout)
    assert "\\x1b[31mred\\x1b[0m\\u202eevil\\x85\\x7f" in r.stdout  # shown, escaped
    assert "self_attn.qkv_proj" in r.stdout and "'model.layers.0.self_attn.qkv_proj'" not in (
        r.stdout
    )  # ordinary names are shown as they are
    js = mpack_cli("inspect", sc, "--json")
    assert js.returncode == 0, js.stderr
    assert ESC_NAME in json.loads(js.stdout)["layers"]  # faithful to the file
    assert "\x1b" not in js.stdout  # JSON's own escapes


def test_inspect_shows_escaped_manifest_strings(sc):
    def edit(m: dict[str, Any]) -> None:
        m["created_by"] = "mpack \x1b]0;pwned\x07"
        m["target"]["engine_version"] = "0.33.0\x1b[2J"
        m["source"] = {"kind": "local", "path": "/nowhere/\x1b[31m", "files": []}
        del m["layers"][OLD]["strategy"]  # an informative key left out: shown as "?"

    edit_manifest(sc, edit)
    r = mpack_cli("inspect", sc)
    assert r.returncode == 0, r.stderr
    assert not raw_in(r.stdout + r.stderr)
    assert "\\x1b]0;pwned\\x07" in r.stdout and "\\x1b[2J" in r.stdout and "\\x1b[31m" in r.stdout


@pytest.mark.parametrize("cmd", [("verify",), ("serve", "--device", "cpu")])
def test_a_huge_escaping_layer_name_is_escaped_and_capped_in_errors(sc, cmd):
    # named in the manifest only: the rank file's tensors no longer match, and both commands
    # name the missing tensors
    huge = ESC_NAME + "x" * BIG
    rename_layer(sc, huge, in_rank_file=False)
    r = mpack_cli(*cmd, sc)
    assert r.returncode == 2 and "READY" not in r.stdout, r.stderr[-500:]
    assert not raw_in(r.stderr), raw_in(r.stderr)
    assert len(r.stderr) < 20_000, len(r.stderr)  # was 40 MB for verify
    assert "is missing" in r.stderr and f"({len(huge) + len('.weight')} characters)" in r.stderr
    assert "\\x1b[31mred" in r.stderr


def test_load_escapes_and_caps_the_name_in_its_error(sc):
    huge = ESC_NAME + "x" * BIG
    rename_layer(sc, huge, in_rank_file=False)
    with pytest.raises(CorruptFileError, match="is missing") as e:
        load(sc, rank=0)
    assert not raw_in(str(e.value)) and len(str(e.value)) < 5_000, len(str(e.value))


def test_verify_escapes_an_unlisted_file_name_and_the_recorded_source(sc):
    (sc / "odd\x1b[2Jname").write_bytes(b"x")
    edit_manifest(
        sc,
        lambda m: m.__setitem__(
            "source", {"kind": "local", "path": "/nowhere/\x1b[31m", "files": []}
        ),
    )
    r = mpack_cli("verify", sc)
    assert r.returncode == 2, r.stderr
    assert not raw_in(r.stdout + r.stderr), (r.stdout, r.stderr)
    assert "'odd\\x1b[2Jname': not listed" in r.stderr
    assert "mpack convert '/nowhere/\\x1b[31m' -o" in r.stderr  # the regenerate hint, escaped


def test_a_recorded_hub_repo_that_is_no_repo_id_is_refused_escaped(sc):
    edit_manifest(
        sc,
        lambda m: m.__setitem__(
            "source",
            {
                "kind": "hub",
                "repo": "org/\x1b[31mrepo",
                "revision": "a" * 40,
                "requested_revision": None,
                "files": [],
            },
        ),
    )
    r = mpack_cli("verify", sc)  # was exit 1: huggingface_hub's HFValidationError
    assert r.returncode == 2 and "not a Hugging Face repo id" in r.stderr, r.stderr
    assert "org/\\x1b[31mrepo" in r.stderr and not raw_in(r.stderr)


def test_verify_escapes_the_recorded_source_path_in_its_note(sc):
    edit_manifest(
        sc,
        lambda m: m.__setitem__(
            "source", {"kind": "local", "path": "/nowhere/\x1b[31m\u202e", "files": []}
        ),
    )
    r = mpack_cli("verify", sc)
    assert r.returncode == 0, r.stderr
    assert "source not checked" in r.stdout and "\\x1b[31m\\u202e" in r.stdout
    assert not raw_in(r.stdout + r.stderr), r.stdout


# --- the daemon's log and mpack status (what a peer sent) -----------------------------------------


def test_the_daemon_log_escapes_what_a_peer_sent(capsys):
    ui.emit_event({"event": "bad-request", "pid": 7, "message": "op \x1b[2J\u202e" + "y" * BIG})
    err = capsys.readouterr().err
    assert not raw_in(err) and "\\x1b[2J\\u202e" in err and len(err) < 5_000


def test_status_escapes_a_peers_sidecar_and_device(capsys, monkeypatch):
    monkeypatch.setattr(ui.console, "width", 400)
    doc = {
        "state": "serving",
        "sidecar": "/x/\x1b[31msc",
        "rank": 0,
        "tp_size": 1,
        "device": "cpu",
        "device_label": "cpu\x1b[2J",
        "bytes": 1,
        "clients": [],
        "uptime_s": 1,
        "pid": 1,
    }
    ui.emit_status([doc], as_json=False)
    out = capsys.readouterr().out
    assert not raw_in(out) and "\\x1b[31msc" in out and "\\x1b[2J" in out, out


def test_a_sidecar_given_as_source_quotes_what_its_manifest_records(tmp_path):
    """convert's "already an mpack sidecar" message reads the manifest leniently (any version),
    but what it quotes from it is escaped like every other message."""
    sc = tmp_path / "sc"
    sc.mkdir()
    recorded = {"source": {"kind": "local", "path": "/models/\x1b[31mred" + "x" * 5000}}
    (sc / MANIFEST_NAME).write_text(json.dumps(recorded))
    r = cli("convert", str(sc), "-o", str(tmp_path / "out"))
    assert r.returncode == 2, r.stderr
    assert "already an mpack sidecar" in r.stderr
    assert "\x1b" not in r.stderr and "\\x1b[31m" in r.stderr
    assert not (tmp_path / "out").exists()
