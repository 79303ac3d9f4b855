"""Issue 42, item 7: the habits every command shares (Note [CLI habits] in mpack/cli.py).

* ``-v``/``-q`` on every command, before or after its name; ``-q`` prints nothing but errors;
* one ``--json`` shape: an object with a top-level ``ok``, the manifest digest always as
  ``manifest_digest``, floats without noise;
* ``mpack --help`` lists every environment variable, from the one table (``mpack.env``);
* library errors name the library's arguments (``device='cuda:0'``), the CLI its flags.

CLI runs are real ``mpack`` subprocesses with their output piped, as CI sees them.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import typer

import mpack.convert as mc
from mpack import cli as mpack_cli
from mpack import env
from mpack.errors import UnsupportedSchemeError, UsageError, arg
from mpack.fixtures import make_checkpoint
from mpack.runtime import attach
from mpack.runtime.spawn import spawn
from tests.convert.helpers import cli, cli_env, explain, messages
from tests.runtime.rt_helpers import child_env

REPO = Path(__file__).resolve().parents[1]


def _commands() -> dict[str, Any]:
    """Every ``mpack`` command as click sees it, by name."""
    return typer.main.get_command(mpack_cli.app).commands  # type: ignore[attr-defined]


# --- -v / -q everywhere ---------------------------------------------------------------------------


def test_every_command_takes_v_and_q() -> None:
    names = set(_commands())
    assert {"layout", "convert", "inspect", "verify", "push", "serve", "status"} <= names
    for name in sorted(names):
        r = cli(name, "-h")
        assert r.returncode == 0, explain(r)
        for flag in (r"-v, --verbose", r"-q, --quiet"):
            assert re.search(rf"^\s+{flag}\s", r.stdout, re.M), (name, flag, r.stdout)


@pytest.fixture(scope="module")
def sidecar(converted) -> Path:
    return converted[1]


@pytest.mark.parametrize(
    "args",
    [
        ("layout", "4096", "4096", "-q"),
        ("-q", "layout", "4096", "4096"),
        ("inspect", "{sc}", "-q"),
        ("-q", "inspect", "{sc}"),
        ("verify", "{sc}", "-q"),
        ("status", "-q"),
    ],
    ids=lambda a: " ".join(a),
)
def test_quiet_prints_nothing_but_errors(sidecar, tmp_path, args) -> None:
    argv = [a.format(sc=sidecar) for a in args]
    r = cli(*argv, env={"XDG_RUNTIME_DIR": str(tmp_path), "MPACK_PROGRESS_EVERY": "0.1"})
    assert r.returncode == 0, explain(r)
    assert (r.stdout, r.stderr) == ("", ""), explain(r)


def test_verbose_after_the_command_works(sidecar) -> None:
    r = cli("inspect", sidecar, "-v")
    assert r.returncode == 0 and "linear layers" in r.stdout, explain(r)


@pytest.mark.parametrize(
    "args, said",
    [
        (("inspect", "{sc}", "-v", "-q"), "-v (--verbose) and -q (--quiet) contradict each other"),
        (("-v", "inspect", "{sc}", "-q"), "-v (--verbose) and -q (--quiet) contradict each other"),
        (("inspect", "{sc}", "--json", "-q"), "--json and --quiet contradict each other"),
        (("-q", "layout", "64", "64", "--json"), "--json and --quiet contradict each other"),
    ],
)
def test_contradicting_habits_are_refused(sidecar, args, said) -> None:
    r = cli(*[a.format(sc=sidecar) for a in args])
    assert r.returncode == 2, explain(r)
    assert messages(r.stderr).startswith(f"error: {said}; pick one"), r.stderr


# --- one --json shape -----------------------------------------------------------------------------


def _keys(doc: Any, prefix: str = "") -> list[str]:
    """Every key path of ``doc``."""
    if isinstance(doc, dict):
        return [p for k, v in doc.items() for p in [f"{prefix}{k}", *_keys(v, f"{prefix}{k}.")]]
    if isinstance(doc, list):
        return [p for v in doc for p in _keys(v, prefix)]
    return []


def _floats(doc: Any, key: str = "") -> list[tuple[str, float]]:
    if isinstance(doc, float):
        return [(key, doc)]
    if isinstance(doc, dict):
        return [f for k, v in doc.items() for f in _floats(v, f"{key}.{k}")]
    if isinstance(doc, list):
        return [f for v in doc for f in _floats(v, key)]
    return []


#: Every ``--json`` document the fixture below collects: one per command and form.
DOCUMENTS = [
    "layout",
    "convert",
    "convert-many",
    "inspect",
    "inspect-many",
    "verify",
    "verify-many",
    "push",
    "status",
    "status-sidecar",
    "status-socket",
    "serve",
]


@pytest.fixture(scope="module")
def documents(tmp_path_factory) -> dict[str, dict[str, Any]]:
    """The ``--json`` document of every command that has one, on one small checkpoint; for
    ``serve``, every event line of a real daemon's life, with ``status`` asked meanwhile."""
    root = tmp_path_factory.mktemp("json")
    ck = make_checkpoint(root / "ck", arch="llama", scheme="FP8", layers=1)
    runs = {
        "layout": ("layout", "4096", "14336"),
        "convert": ("convert", ck, "-o", root / "sc"),
        "convert-many": ("convert", ck, "-o", root / "many", "--tp", "1,2"),
        "inspect": ("inspect", root / "sc"),
        "inspect-many": ("inspect", root / "many"),
        "verify": ("verify", root / "sc", "--source", ck),
        "verify-many": ("verify", root / "many", "--source", ck),
        "push": ("push", root / "sc", "org/name", "--dry-run"),
    }
    docs = {}
    for name, args in runs.items():
        r = cli(*args, "--json")
        assert r.returncode == 0, explain(r)
        docs[name] = json.loads(r.stdout)
    xdg = root / "xdg"
    xdg.mkdir(mode=0o700)
    env = {"XDG_RUNTIME_DIR": str(xdg)}
    asks = {"status": (), "status-sidecar": (root / "sc",), "status-socket": ("--socket",)}
    # a daemon, and a client of it: for the status documents and the events
    with (
        spawn(root / "sc", args=["--json"], env=child_env(xdg), log_dir=root) as d,
        attach(root / "sc", device="cpu", socket=d.socket),
    ):
        for name, args in asks.items():
            extra = (d.socket,) if name == "status-socket" else ()
            r = cli("status", *args, *extra, "--json", env=env)
            assert r.returncode == 0, explain(r)
            docs[name] = json.loads(r.stdout)
    assert d.proc.returncode == 0 and d.out_path is not None
    lines = d.out_path.read_text().splitlines()
    docs["serve"] = {"ok": True, "lines": [json.loads(line) for line in lines]}
    return docs


@pytest.mark.parametrize("name", DOCUMENTS)
def test_every_document_is_an_object_with_ok(documents, name) -> None:
    doc = documents[name]
    assert isinstance(doc, dict) and doc["ok"] is True, doc


def test_status_lists_its_daemons_under_one_key(documents) -> None:
    digest = documents["inspect"]["manifest_digest"]
    for name in ("status", "status-sidecar", "status-socket"):
        (daemon,) = documents[name]["daemons"]
        assert set(documents[name]) == {"ok", "daemons"}, documents[name]
        assert daemon["state"] == "serving" and daemon["manifest_digest"] == digest, daemon
        assert len(daemon["clients"]) == 1, daemon


def test_every_serve_event_line_is_a_document(documents) -> None:
    lines = documents["serve"]["lines"]
    assert [x["event"] for x in lines][:2] == ["loading", "ready"], lines
    assert {"attached", "detached", "stopping", "stopped"} <= {x["event"] for x in lines}
    for line in lines:
        assert line["ok"] is True, line
    (ready,) = [x for x in lines if x["event"] == "ready"]
    assert ready["manifest_digest"] == documents["inspect"]["manifest_digest"], ready


@pytest.mark.parametrize("name", [n for n in DOCUMENTS if n != "layout"])
def test_the_manifest_digest_has_one_name(documents, name) -> None:
    keys = _keys(documents[name])
    leaves = {k.rpartition(".")[2] for k in keys}
    assert "digest" not in leaves, keys
    named = [k for k in keys if k.endswith("manifest_digest")]
    assert named, keys
    for k in named:
        value = documents[name]
        for part in k.split("."):
            # in a list (targets, daemons, event lines), the items that have it
            value = (
                value[part] if isinstance(value, dict) else [v[part] for v in value if part in v]
            )
        for v in value if isinstance(value, list) else [value]:
            assert re.fullmatch(r"[0-9a-f]{64}", v), (k, v)


def _noiseless(floats: list[tuple[str, float]]) -> None:
    """Times (``.seconds.``, ``*_s``) to the millisecond, any other float to 6 digits."""
    for key, x in floats:
        if ".seconds." in key + "." or key.endswith("_s"):
            assert round(x, 3) == x, (key, x)
        else:
            assert float(f"{x:.6g}") == x, (key, x)


@pytest.mark.parametrize(
    "name", ["convert", "convert-many", "verify", "verify-many", "status", "serve"]
)
def test_no_float_noise(documents, name) -> None:
    floats = _floats(documents[name])
    assert floats, documents[name]  # the timings, at least
    _noiseless(floats)


def test_a_failure_after_the_work_is_one_document_with_the_facts(documents, tmp_path) -> None:
    """``verify --forward`` whose model outputs differ (a tolerance below any difference): one
    document, the error's, with what was compared; not the result and then an error."""
    sc = Path(documents["verify"]["sidecar"])
    code = (
        "import sys; from mpack.verify import forward; from mpack.cli import main; "
        "forward.REL_TOL.update(dict.fromkeys(forward.REL_TOL, -1.0)); "
        "sys.exit(main(sys.argv[1:]))"
    )
    source = documents["verify"]["source"]
    for target in (sc, sc.parent / "many"):  # one sidecar, and a directory of two targets
        argv = ["verify", str(target), "--source", source, "--forward", "--json"]
        r = subprocess.run(
            [sys.executable, "-c", code, *argv],
            capture_output=True,
            text=True,
            env=cli_env(),
            timeout=300,
        )
        assert r.returncode == 2, explain(r)
        doc = json.loads(r.stdout)  # exactly one document
        assert doc["ok"] is False and doc["error"]["code"] == "VerificationError", doc
        assert "model outputs from the sidecar differ" in doc["error"]["message"], doc
        runs = [doc] if target == sc else doc["targets"]
        assert len(runs) == (1 if target == sc else 2), doc
        for one in runs:
            assert one["forward"]["ok"] is False and one["ok"] is False, one
            assert re.fullmatch(r"[0-9a-f]{64}", one["manifest_digest"]), one
        assert "digest" not in {k.rpartition(".")[2] for k in _keys(doc)}
        _noiseless(_floats(doc))


def test_the_rounding_rule() -> None:
    from mpack import ui

    doc = {
        "seconds": {"total": 0.123456789},
        "load_s": 2.0004999,
        "x": 1 / 3,
        "n": 3,
        "nan": math.nan,
    }
    got = ui.plain_floats(doc)
    assert got["seconds"] == {"total": 0.123} and got["load_s"] == 2.0 and got["x"] == 0.333333
    assert got["n"] == 3 and math.isnan(got["nan"])


# --- the environment variables, from one table ----------------------------------------------------


def test_the_help_lists_the_one_table() -> None:
    assert env.help_entries() == mpack_cli.ENVIRONMENT  # derived, not a second table
    r = cli("--help")
    assert r.returncode == 0, explain(r)
    flat = " ".join(r.stdout.split())
    for v in env.VARIABLES:
        assert f"{v.name}={v.value} {' '.join(v.effect.split())}" in flat, v.name


def test_the_readme_lists_the_table_in_its_order() -> None:
    readme = (REPO / "README.md").read_text()
    section = readme.split("\n## Environment variables\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(MPACK_\w+)=([^`]+)`", section, re.M)
    assert rows == [(v.name, v.value) for v in env.VARIABLES], rows


# --- library errors in the library's words --------------------------------------------------------


def test_flags_name_real_options() -> None:
    """Each library argument the CLI rewords is an option of some command."""
    flags = {o for c in _commands().values() for p in c.params for o in getattr(p, "opts", [])}
    for name, words in mpack_cli.FLAGS.items():
        flag = words(None, False).split()[0]
        assert flag in flags, (name, flag)


def test_arg_speaks_as_the_interface_does() -> None:
    assert (arg("device"), arg("device", "cuda:0"), arg("tp", 3)) == (
        "device",
        "device='cuda:0'",
        "tp=3",
    )
    from mpack.errors import worded

    with worded(mpack_cli.FLAGS):
        said = [arg("device", "cuda:0"), arg("tp", 3), arg("force", True), arg("ep", True)]
        said += [arg("passthrough", False), arg("out", "x"), arg("rederive_device")]
        assert said == ["--device cuda:0", "--tp 3", "--force", "--ep on", "--no-passthrough"] + [
            "-o x",
            "--rederive-device",
        ]
    assert arg("device") == "device"  # back to the API's words after the block


def test_a_library_error_names_arguments_and_the_cli_flags(tmp_path) -> None:
    ck = make_checkpoint(tmp_path / "ck", arch="llama", scheme="FP8", layers=1)  # 4 heads
    with pytest.raises(UnsupportedSchemeError) as e:
        mc.convert(ck, tmp_path / "out", tp=3, device="cpu")
    assert "tp=3 does not divide num_attention_heads=4" in e.value.message
    assert "--tp" not in e.value.message + (e.value.hint or "")
    with pytest.raises(UsageError, match=r"^backend must be auto or one of") as e2:
        mc.convert(ck, tmp_path / "out", backend="rocm")
    assert "--" not in e2.value.message
    r = cli("convert", ck, "-o", tmp_path / "out", "--tp", "3")
    assert r.returncode == 2, explain(r)
    assert "--tp 3 does not divide num_attention_heads=4" in r.stderr
    assert "hint: choose a --tp that divides them" in r.stderr
    r = cli("convert", ck, "-o", tmp_path / "out", "--backend", "rocm")
    assert "error: --backend must be auto or one of" in r.stderr, r.stderr
