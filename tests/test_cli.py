"""The CLI's single error table: exit codes, messages, tracebacks only with MPACK_DEBUG=1."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import typer

from mpack import cli
from mpack.errors import (
    CorruptFileError,
    DaemonError,
    InputError,
    MpackError,
    ProtocolError,
    SourceNotFoundError,
    UsageError,
    exit_code_for,
)


def _mpack(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mpack.cli", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=120,
    )


def test_help_and_version():
    r = _mpack("--help")
    assert r.returncode == 0 and "layout" in r.stdout
    r = _mpack("--version")
    assert r.returncode == 0 and r.stdout.startswith("mpack ")


def test_layout_json_matches_the_padding_rule():
    r = _mpack("layout", "960", "576", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert (doc["Np"], doc["Kp"]) == (1024, 576)
    assert doc["weight"]["shape"] == [36, 4096]


def test_bad_value_is_exit_2_with_message_and_no_traceback():
    r = _mpack("layout", "960", "6")
    assert r.returncode == 2
    assert "K=6" in r.stderr and "Traceback" not in r.stderr


def test_click_usage_error_is_exit_2():
    r = _mpack("layout", "960")
    assert r.returncode == 2 and "Missing argument" in r.stderr


def test_internal_error_is_exit_1_traceback_only_with_debug(monkeypatch, capsys):
    from mpack import target

    def broken(n, k):
        raise RuntimeError("synthetic bug")

    monkeypatch.setattr(target, "padded_nk", broken)
    monkeypatch.delenv("MPACK_DEBUG", raising=False)
    assert cli.main(["layout", "64", "128"]) == 1
    err = capsys.readouterr().err
    assert "internal error: RuntimeError: synthetic bug" in err and "Traceback" not in err
    monkeypatch.setenv("MPACK_DEBUG", "1")
    assert cli.main(["layout", "64", "128"]) == 1
    assert "Traceback" in capsys.readouterr().err


def test_mpack_error_prints_hint(monkeypatch, capsys):
    from mpack import target

    def refuse(n, k):
        raise InputError(f"layer x: N={n} is odd", hint="run `mpack layout --help`")

    monkeypatch.setattr(target, "padded_nk", refuse)
    assert cli.main(["layout", "64", "128"]) == 2
    err = capsys.readouterr().err
    assert "error: layer x: N=64 is odd" in err and "hint: run `mpack layout --help`" in err


@pytest.mark.parametrize(
    "exc, code, base",
    [
        (UsageError("u"), 2, ValueError),
        (InputError("i"), 2, ValueError),
        (SourceNotFoundError("s"), 2, FileNotFoundError),
        (CorruptFileError("c"), 2, ValueError),
        (DaemonError("d"), 2, ConnectionError),
        (ProtocolError("p"), 2, DaemonError),  # a peer's fault, not mpack's (issue 24.6)
        (MpackError("m"), 1, Exception),
        (RuntimeError("r"), 1, Exception),
    ],
)
def test_error_table(exc, code, base):
    assert exit_code_for(exc) == code
    assert isinstance(exc, base)


def test_every_option_names_its_flags() -> None:
    """Each option declares its flag names itself: typer releases differ in the name they derive
    from a parameter that has a metavar but no name (typer 0.27 made `--source` into `--SOURCE`)."""
    import inspect
    import typing

    from mpack import cli

    missing = []
    for command in cli.app.registered_commands:
        fn = command.callback
        for name, hint in typing.get_type_hints(fn, include_extras=True).items():
            infos = [
                m
                for m in getattr(hint, "__metadata__", ())
                if isinstance(m, typer.models.OptionInfo)
            ]
            # with Annotated, the first name passed to typer.Option lands in ``default``
            names = [*infos[0].param_decls, infos[0].default] if infos else []
            if infos and not any(isinstance(n, str) and n.startswith("--") for n in names):
                missing.append(f"{fn.__name__}({name})")
        assert inspect.signature(fn).parameters  # the walk saw the command's parameters
    assert not missing, f"options without explicit flag names: {missing}"
