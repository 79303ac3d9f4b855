"""What a new user sees (issue 12): the rendered help, errors as JSON, output in pipes and CI logs.

Every run is a real ``mpack`` subprocess (tests/convert/helpers.py ``cli``) with its output
captured, i.e. piped, as in CI: what these tests read is what a CI log shows.
"""

from __future__ import annotations

import functools
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mpack.fixtures import make_checkpoint
from tests.convert.helpers import cli, cli_env, messages

run = functools.partial(cli, timeout=300)


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> tuple[Path, Path, subprocess.CompletedProcess]:
    """A tiny checkpoint, converted by the CLI with stderr piped (periodic progress lines), to an
    output path long enough that 80-column wrapping would break it."""
    root = tmp_path_factory.mktemp("cli-output")
    ck = root / "ck"
    make_checkpoint(ck, arch="llama", scheme="FP8", layers=2)
    out = root / ("a-rather-long-directory-name-for-a-sidecar-" * 3 + "marlin")
    r = run("convert", ck, "-o", out, "--tp", "2", env={"MPACK_PROGRESS_EVERY": "0.2"})
    assert r.returncode == 0, r.stderr
    return ck, out, r


# --- help -----------------------------------------------------------------------------------


def test_convert_help_tells_the_truth():
    r = run("convert", "-h")
    assert r.returncode == 0, r.stderr
    h = r.stdout
    assert "Usage: mpack convert [OPTIONS] SOURCE" in h
    assert "{" not in h  # no "{source}"
    assert "<bool>" not in h  # flags take no value
    for flag in ("--force", "--no-passthrough", "--json", "--quiet"):
        assert re.search(rf"^\s+(-\w, )?{flag}\s{{2,}}\S", h, re.M), flag  # "--force   Redo ..."
    for choices in (
        "[w8a16|w8a8-marlin]",
        "[bfloat16|float16]",
        "[vllm|none]",
        "[auto|cpu|cuda|cuda:N]",
    ):
        assert choices in h, choices
    flat = " ".join(h.split())
    assert "[default: the checkpoint's dtype]" in flat
    assert "Examples:" in h and "mpack convert ./my-fp8-model -o out" in h


def test_root_help_keeps_examples_and_lists_the_environment():
    r = run("-h")
    assert r.returncode == 0
    assert "  Examples:\n    mpack convert ./fp8-checkpoint -o ./sidecar --tp 2" in r.stdout
    for name in ("MPACK_DEBUG", "MPACK_PROGRESS_EVERY", "MPACK_GOLDEN"):
        assert name in r.stdout
    assert "--install-completion" in r.stdout and "--verbose" in r.stdout


def test_verify_and_status_help():
    v = " ".join(run("verify", "--help").stdout.split())
    assert "[default: the recorded local path" in v
    s = run("status", "-h").stdout
    options = " ".join(s.split("Options:")[1].split())
    assert "--socket PATH" in s
    # --rank: the readiness probe of one rank, with SIDECAR (status --rank), listed once
    assert options.count("--rank") == 1, options
    assert "--rank R With SIDECAR: only rank R (its daemons; ready once it is served). " in options
    assert "[default: every rank]" in options


def test_python_dash_m_mpack_runs_the_cli():
    r = subprocess.run(
        [sys.executable, "-m", "mpack", "--version"],
        capture_output=True,
        text=True,
        timeout=60,
        env=cli_env(),
    )
    assert r.returncode == 0 and r.stdout.startswith("mpack ")


# --- errors as JSON -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, code, kind",
    [
        (("inspect", "/nonexistent/sidecar"), 2, "SourceNotFoundError"),
        (("convert", "/nonexistent/ck", "-o", "/tmp/x"), 2, "SourceNotFoundError"),
        (("convert", "ck", "--bogus"), 2, "UsageError"),
        (("convert", "ck", "-o", ""), 2, "UsageError"),
    ],
)
def test_json_failure_is_one_document_with_the_same_exit_code(args, code, kind):
    plain, js = run(*args), run(*args, "--json")
    assert plain.returncode == js.returncode == code, (plain.stderr, js.stdout)
    assert messages(plain.stderr).startswith("error: ")
    doc = json.loads(js.stdout)  # exactly one JSON document on stdout
    assert doc["ok"] is False
    err = doc["error"]
    assert err["code"] == kind and err["exit_code"] == code
    assert err["message"] and err["message"] in plain.stderr
    assert set(err) == {"code", "exit_code", "message", "file", "hint"}
    if args[1].startswith("/nonexistent"):
        assert err["file"] == args[1]


def test_usage_errors_follow_the_error_contract():
    r = run("convert", "ck", "--bogus")
    assert r.returncode == 2
    assert r.stderr.startswith("error: No such option: --bogus")
    assert "hint: see `mpack convert -h`" in r.stderr


# --- output in pipes and CI logs ------------------------------------------------------------


def test_piped_output_is_not_wrapped(converted):
    _, out, r = converted
    lines = r.stdout.splitlines()
    assert any(line.startswith("wrote ") and str(out) in line for line in lines), r.stdout
    digest = next(line for line in lines if line.startswith("manifest digest "))
    assert re.fullmatch(r"manifest digest [0-9a-f]{64}", digest)
    i = run("inspect", out)
    assert str(out) in i.stdout and re.search(r"manifest digest: [0-9a-f]{64}\n", i.stdout)


def test_a_ci_log_gets_progress_lines(converted):
    _, _, r = converted
    lines = [line for line in r.stderr.splitlines() if line.startswith("convert: ")]
    assert len(lines) >= 2, r.stderr  # a line every 0.2 s while the run lasts
    assert "\r" not in r.stderr and "\x1b[" not in r.stderr  # plain lines, no bars or colours
    assert any(re.search(r"\d+(\.\d+)? (KiB|MiB) (written|/)", line) for line in lines), lines


def test_layer_counts_say_what_they_count(converted):
    _, out, r = converted
    assert "8 linear layers (2 decoder layers) x 2 rank(s)" in r.stdout
    assert "8 linear layers (2 decoder layers), per rank" in run("inspect", out).stdout


def test_inspect_shows_digests_and_real_chunk_sizes(converted):
    _, out, _ = converted
    i = run("inspect", out).stdout
    row = next(line for line in i.splitlines() if "generation_config.json" in line)
    size = (out / "generation_config.json").stat().st_size
    assert re.search(r"[0-9a-f]{16}\.\.\.", row) and f"1 x {size} B" in row, row
    assert "64.00 MiB" not in i


def test_verbose_flag_is_accepted_and_quiet_by_default(converted):
    _, out, _ = converted
    r = run("-v", "inspect", out)
    assert r.returncode == 0 and "linear layers" in r.stdout


def test_verify_forward_keeps_other_libraries_quiet(converted):
    """transformers / compressed-tensors progress bars and logs stay out of the output (without
    -v): stdout is one JSON document, stderr holds nothing but mpack's own lines."""
    ck, out, _ = converted
    r = run("verify", out, "--source", ck, "--forward", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["forward"]["ok"] is True
    noise = [line for line in r.stderr.splitlines() if line.strip()]
    assert noise == [], r.stderr
