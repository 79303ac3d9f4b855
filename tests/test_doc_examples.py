"""Every example of README.md and docs/*.md runs as written, or says why it cannot.

Each fenced block in a shell or Python language (no language, ``sh``, ``bash``, ``console``,
``shell``, ``python``) runs here, unless the line right before its fence is a marker
``<!-- not run: REASON -->`` with one of :data:`REASONS`. Blocks that are not commands carry
their language (``json``, ``ini``, ``yaml``, ``text``); any other language is unclassified
and fails, with the file and line.

How a block runs: shell blocks verbatim through ``bash -e``, Python blocks with this
interpreter, each in a fresh directory prepared so that it works offline:

* ``my-fp8-model``: a tiny real FP8 checkpoint (:func:`mpack.fixtures.make_checkpoint`);
* every Hub repo a block names (``RedHatAI/...``): the same checkpoint in a Hugging Face cache
  laid out as a finished download (``hf_cache.add_repo``), with ``HF_HUB_OFFLINE=1``;
* ``llama8b-marlin``: its sidecar at ``--tp 2``, as the README converts it, where a block uses
  it without writing it;
* ``mpack`` on ``PATH`` from this interpreter's venv, a private ``HOME``, cache and runtime
  directory.

The markers are checked too: each stands right before a block that would run, and the block
shows why it cannot (a GPU device, ``vllm serve``, ``pip install``, ``make``, ``mpack push``).
A shell block that starts a background job (``&``) must be marked: ``bash -e`` cannot see it
fail. Every ``mpack`` command line in a shell block, run or not, must parse with mpack's own
CLI, and the examples must agree on tensor-parallel sizes and ranks across the docs (a sidecar
converted with ``--tp 2`` is served as ranks 0 and 1 and run by vLLM at
``--tensor-parallel-size 2``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

#: Languages whose blocks are commands, and how they run.
RUNS = {"": "sh", "sh": "sh", "bash": "sh", "console": "sh", "shell": "sh", "python": "python"}
#: Languages of blocks that are not commands (data, unit files, diagrams, output, synopses).
NOT_COMMANDS = {"json", "ini", "yaml", "text"}
#: Why a block may not run here, and what the block must show for that reason to hold.
REASONS = {
    "needs a GPU": re.compile(r"cuda|gpu", re.I),
    "needs vLLM and a GPU": re.compile(r"\bvllm serve\b"),
    "installs packages": re.compile(r"\bpip install\b"),
    "runs make": re.compile(r"^make ", re.M),
    "needs the Hugging Face Hub": re.compile(r"\bmpack push\b|--push\b"),
}
MARKER = re.compile(r"^<!-- not run: (?P<reason>.+?) -->$")
OPEN = re.compile(r"^(?P<indent> *)```(?P<lang>[^`\s]*)\s*$")
#: A command line that ends in ``&`` (before any comment): a background job.
BACKGROUND = re.compile(r"(?<![&>|])&[ \t]*(#.*)?$", re.M)
#: A checkpoint directory and a sidecar directory the examples name without making them.
CHECKPOINT, SIDECAR = "my-fp8-model", "llama8b-marlin"
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
COMMIT = "d0c5e8a3" * 5  # the commit the cached Hub repos are "downloaded" at


@dataclass(frozen=True)
class Block:
    doc: Path
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    reason: str | None  # the marker's reason, None without a marker

    @property
    def where(self) -> str:
        return f"{self.doc.relative_to(REPO)}:{self.line}"

    @property
    def runs(self) -> bool:
        return self.lang in RUNS and self.reason is None


def parse(doc: Path, text: str | None = None) -> tuple[list[Block], list[str]]:
    """The fenced blocks of ``doc`` and the problems of its markers and languages."""
    lines = (doc.read_text() if text is None else text).splitlines()
    blocks, problems, used = [], [], set()
    i = 0
    while i < len(lines):
        m = OPEN.match(lines[i])
        if not m:
            i += 1
            continue
        end = i + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        where = f"{doc.relative_to(REPO)}:{i + 1}"
        if end == len(lines):
            problems.append(f"{where}: a fence that is never closed")
            break
        prev = MARKER.match(lines[i - 1]) if i else None
        lang, reason = m["lang"], prev["reason"] if prev else None
        if prev:
            used.add(i - 1)
        body = "\n".join(s.removeprefix(m["indent"]) for s in lines[i + 1 : end]) + "\n"
        if lang not in RUNS and lang not in NOT_COMMANDS:
            problems.append(
                f"{where}: a ```{lang} block is unclassified: use a language of "
                f"{sorted(set(RUNS) | NOT_COMMANDS)}"
            )
        elif reason is not None and lang not in RUNS:
            problems.append(f"{where}: a 'not run' marker on a ```{lang} block, which never runs")
        elif reason is not None:
            known = [r for r in REASONS if reason == r or reason.startswith(r + " (")]
            if not known:
                problems.append(f"{where}: unknown reason {reason!r}; one of {list(REASONS)}")
            elif not REASONS[known[0]].search(body):
                problems.append(f"{where}: marked {known[0]!r}, but nothing in the block does")
        elif RUNS.get(lang) == "sh" and BACKGROUND.search(body):
            # bash -e never sees a background job fail, and a daemon that works never ends
            problems.append(f"{where}: starts a background job (&), which cannot run here: mark it")
        blocks.append(Block(doc, i + 1, lang, body, reason))
        i = end + 1
    for n, line in enumerate(lines):
        if MARKER.match(line) and n not in used:
            problems.append(f"{doc.relative_to(REPO)}:{n + 1}: a marker not right before a fence")
        elif re.match(r"\s*<!--\s*not[\s_-]*run", line, re.I) and not MARKER.match(line):
            problems.append(f"{doc.relative_to(REPO)}:{n + 1}: write it <!-- not run: REASON -->")
    return blocks, problems


def all_blocks() -> list[Block]:
    return [b for doc in DOCS for b in parse(doc)[0]]


# --- classification ------------------------------------------------------------------------


def test_every_block_is_classified() -> None:
    """Each block of the docs runs, carries a well-formed marker, or is not a command."""
    problems = [p for doc in DOCS for p in parse(doc)[1]]
    assert not problems, "\n".join(problems)
    blocks = all_blocks()
    assert sum(b.runs for b in blocks) >= 5, [b.where for b in blocks if b.runs]


def test_unclassified_and_bad_markers_are_reported() -> None:
    doc = REPO / "README.md"
    text = "\n".join(
        [
            "```zsh",
            "mpack --help",
            "```",  # unknown language
            "<!-- not run: needs a GPU -->",
            "```json",
            "{}",
            "```",  # marker on data
            "<!-- not run: too slow -->",
            "```",
            "mpack --help",
            "```",  # unknown reason
            "<!-- not run: needs a GPU -->",
            "```",
            "mpack inspect x",
            "```",  # no GPU in it
            "<!-- not run: runs make -->",
            "",
            "```",
            "make test",
            "```",  # marker not on a fence
            "<!-- not-run: needs a GPU -->",
            "```",
            "mpack --help",
            "```",  # misspelt marker
            "```",
            "mpack serve sc --device cpu &  # a daemon",
            "mpack status",
            "```",  # background
        ]
    )
    blocks, problems = parse(doc, text)
    assert [b.line for b in blocks] == [1, 5, 9, 13, 18, 22, 25]
    assert len(problems) == 7, problems
    for line, words in [
        (1, "unclassified"),
        (5, "never runs"),
        (9, "unknown reason"),
        (13, "nothing in the block"),
        (16, "not right before"),
        (21, "write it"),
        (25, "background job"),
    ]:
        assert any(p.startswith(f"README.md:{line}: ") and words in p for p in problems), (
            line,
            problems,
        )
    assert [b.runs for b in blocks] == [False, False, False, False, True, True, True]


# --- the commands of every shell block parse ---------------------------------------------------


def logical_lines(text: str) -> list[str]:
    """Lines with backslash continuations joined."""
    return text.replace("\\\n", " ").splitlines()


def mpack_commands(text: str) -> list[list[str]]:
    """The argument lists of every ``mpack ...`` command in a shell block (pipes, ``&``, ``;``
    and redirections end one; comments are dropped)."""
    out = []
    for line in logical_lines(text):
        if not re.search(r"\bmpack\b", line):
            continue
        lex = shlex.shlex(line, posix=True, punctuation_chars=True)
        lex.whitespace_split = True
        cmd: list[str] | None = None
        start = True
        for tok in lex:
            if set(tok) <= set("();<>|&"):
                if cmd is not None:
                    out.append(cmd)
                cmd, start = None, True
                continue
            if cmd is not None:
                cmd.append(tok)
            elif start and tok == "mpack":
                cmd = []
            start = False
        if cmd is not None:
            out.append(cmd)
    return out


def cli_problem(args: list[str]) -> str | None:
    """Why mpack's CLI would refuse ``args`` before running anything, or None."""
    import typer

    from mpack import cli

    root = typer.main.get_command(cli.app)
    if not args or args[0] not in root.commands:
        return f"no command {args[:1]} (mpack has {sorted(root.commands)})"
    try:
        root.commands[args[0]].make_context(args[0], list(args[1:]))
    except Exception as e:  # click's UsageError and its subclasses
        return f"{type(e).__name__}: {e}"
    return None


def test_every_mpack_command_parses() -> None:
    """Run or not, every ``mpack`` line of a shell block names real commands and options."""
    seen, problems = 0, []
    for b in all_blocks():
        if RUNS.get(b.lang) != "sh":
            continue
        for args in mpack_commands(b.text):
            seen += 1
            why = cli_problem(args)
            if why:
                problems.append(f"{b.where}: mpack {shlex.join(args)}: {why}")
    assert not problems, "\n".join(problems)
    assert seen >= 10


def test_a_wrong_option_is_caught() -> None:
    line = "mpack serve llama8b-marlin --rank 1 --devise cuda:1 &  # typo\nmpack status\n"
    cmds = mpack_commands(line)
    assert cmds == [["serve", "llama8b-marlin", "--rank", "1", "--devise", "cuda:1"], ["status"]]
    assert "--devise" in cli_problem(cmds[0])
    assert cli_problem(cmds[1]) is None
    assert "no command" in cli_problem(["serv"])


# --- tensor-parallel sizes and ranks agree -----------------------------------------------------

CONVERT = re.compile(r"\bmpack convert\s+\S+(?P<rest>.*)")
SERVE = re.compile(r"\bmpack serve\s+(?P<sidecar>\S+)(?P<rest>[^&;|>]*)")
VLLM = re.compile(r"\bvllm serve\s+(?P<sidecar>\S+)(?P<rest>.*)")
PY_CONVERT = re.compile(r"\bconvert\(\s*\"[^\"]+\",\s*\"(?P<out>[^\"]+)\"(?P<rest>[^)]*)\)")
PY_RANK = re.compile(r"\b(?:attach|load|spawn)\(\s*\"(?P<sidecar>[^\"]+)\"(?P<rest>[^)]*)\)")
#: A yaml list of strings on one line (``args: ["vllm", "serve", ...]``): its words.
YAML_LIST = re.compile(r'\[\s*("(?:[^"\\]|\\.)*"(?:\s*,\s*"(?:[^"\\]|\\.)*")*)\s*\]')


def _name(path: str) -> str:
    return Path(path.strip("'\"")).name


def _int(pattern: str, text: str, default: int) -> int | None:
    """The integer after ``pattern`` in ``text`` (``default`` without one, None if not a
    number, like ``%i`` in a systemd unit)."""
    m = re.search(pattern + r"(?:\s+|=)(\S+)", text)
    if not m:
        return default
    return int(m[1]) if m[1].isdigit() else None


def command_text(lang: str, text: str) -> str:
    """The block as lines of commands: continuations joined, yaml string lists as words."""
    if lang == "yaml":
        joined, buf = [], ""
        for line in text.splitlines():
            buf = f"{buf} {line.strip()}" if buf else line
            if buf.count("[") <= buf.count("]"):
                joined.append(buf)
                buf = ""
        text = "\n".join(joined + [buf])
        text = YAML_LIST.sub(lambda m: " ".join(json.loads(f"[{m[1]}]")), text)
    return "\n".join(logical_lines(text))


def tp_problems(docs: dict[str, str]) -> list[str]:
    """Where the examples of ``docs`` (name -> markdown) disagree on a sidecar's TP size.

    A sidecar is known by its directory name. Its TP size is the ``--tp`` of every ``mpack
    convert`` (or ``convert(..., tp=)``) that writes it: those must agree. Then every served or
    attached rank is below it, every ``vllm serve`` of it runs at that
    ``--tensor-parallel-size``, and a block that starts both daemons and vLLM serves every rank.
    Fenced blocks of any language and inline code are read.
    """
    tp: dict[str, set[tuple[int, str]]] = defaultdict(set)
    uses: list[tuple[str, str, str, int | None]] = []  # (where, kind, sidecar, value)
    for name, md in docs.items():
        pieces: list[tuple[str, str, str]] = []  # (where, lang, text)
        lines = md.splitlines()
        i, prose = 0, []
        while i < len(lines):
            m = OPEN.match(lines[i])
            if m:
                end = i + 1
                while end < len(lines) and lines[end].strip() != "```":
                    end += 1
                body = "\n".join(s.removeprefix(m["indent"]) for s in lines[i + 1 : end])
                pieces.append((f"{name}:{i + 1}", m["lang"], body))
                i = end + 1
            else:
                prose.append((i, lines[i]))
                i += 1
        for n, line in prose:
            for span in re.findall(r"`([^`]+)`", line):
                pieces.append((f"{name}:{n + 1}", "inline", span))
        for where, lang, body in pieces:
            text = command_text(lang, body)
            for m in CONVERT.finditer(text):
                out = re.search(r"(?:-o|--out)(?:\s+|=)(\S+)", m["rest"])
                if out:
                    tp[_name(out[1])].add((_int("--tp", m["rest"], 1), where))
            for m in PY_CONVERT.finditer(text):
                tp[_name(m["out"])].add((_int(r"\btp", m["rest"], 1), where))
            for m in SERVE.finditer(text):
                uses.append((where, "rank", _name(m["sidecar"]), _int("--rank", m["rest"], 0)))
            for m in PY_RANK.finditer(text):
                uses.append((where, "rank", _name(m["sidecar"]), _int(r"\brank", m["rest"], 0)))
            for m in VLLM.finditer(text):
                size = _int(r"(?:--tensor-parallel-size|-tp)", m["rest"], 1)
                uses.append((where, "vllm", _name(m["sidecar"]), size))
    problems = []
    sizes: dict[str, int] = {}
    for sidecar, found in tp.items():
        values = {v for v, _ in found if v is not None}
        if len(values) > 1:
            problems.append(f"{sidecar}: converted at different TP sizes: {sorted(found)}")
        if values:
            sizes[sidecar] = min(values)
    served: dict[tuple[str, str], set[int]] = defaultdict(set)  # (block, sidecar) -> ranks
    for where, kind, sidecar, value in uses:
        if sidecar not in sizes or value is None:
            continue
        size = sizes[sidecar]
        if kind == "rank":
            served[(where, sidecar)].add(value)
            if value >= size:
                problems.append(f"{where}: rank {value} of {sidecar}, converted with --tp {size}")
        elif value != size:
            problems.append(
                f"{where}: vllm serve {sidecar} at --tensor-parallel-size {value}, "
                f"converted with --tp {size}"
            )
    for where, kind, sidecar, value in uses:
        ranks = served.get((where, sidecar))
        if kind == "vllm" and value is not None and ranks and ranks != set(range(value)):
            problems.append(
                f"{where}: vllm serve {sidecar} at TP {value}, but the daemons started with it "
                f"serve ranks {sorted(ranks)}"
            )
    return problems


def test_tp_sizes_and_ranks_agree_across_the_docs() -> None:
    docs = {str(d.relative_to(REPO)): d.read_text() for d in DOCS}
    assert not tp_problems(docs), "\n".join(tp_problems(docs))
    # the check sees the examples it is about
    readme = docs["README.md"]
    assert "--tensor-parallel-size 2" in readme and "-o llama8b-marlin --tp 2" in readme


def test_tp_check_catches_the_old_examples() -> None:
    """The sequences issue 23 found: a --tp 2 sidecar run at TP 1 with rank 0 served; a TP 1
    sidecar served as rank 1 for TP 2."""
    fence = "```"
    readme = (
        f"{fence}\nmpack convert org/m -o sc --tp 2\n{fence}\n\n"
        f"{fence}\nmpack serve sc --rank 0 --device cuda:0\n"
        f"vllm serve sc --load-format mpack\n{fence}\n"
    )
    vllm_md = (
        f"{fence}\nmpack convert org/m -o sc\n{fence}\n\n"
        f"{fence}\nmpack serve sc --rank 0 --device cuda:0 &\n"
        f"mpack serve sc --rank 1 --device cuda:1 &\n"
        f"vllm serve sc --tensor-parallel-size 2 --load-format mpack\n{fence}\n"
    )
    one = tp_problems({"README.md": readme})
    assert any("README.md:5: vllm serve sc at --tensor-parallel-size 1" in p for p in one), one
    half = readme.replace("vllm serve sc", "vllm serve sc --tensor-parallel-size 2")
    assert tp_problems({"README.md": half}) == [
        "README.md:5: vllm serve sc at TP 2, but the daemons started with it serve ranks [0]"
    ]
    two = tp_problems({"docs/VLLM.md": vllm_md})
    assert any("rank 1 of sc, converted with --tp 1" in p for p in two), two
    both = tp_problems({"README.md": readme, "docs/VLLM.md": vllm_md})
    assert any("converted at different TP sizes" in p for p in both), both
    yaml = '```yaml\nargs: ["vllm", "serve", "/models/sc",\n       "--load-format", "mpack"]\n```\n'
    three = tp_problems({"README.md": readme.split("\n\n")[0], "k8s.md": yaml})
    assert three == ["k8s.md:1: vllm serve sc at --tensor-parallel-size 1, converted with --tp 2"]


# --- running the examples ----------------------------------------------------------------------

RUNNABLE = [b for b in all_blocks() if b.runs]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The checkpoint, the HF cache with every Hub repo a runnable block names, the sidecar,
    and the environment of a block."""
    pytest.importorskip("torch")
    pytest.importorskip("compressed_tensors")
    pytest.importorskip("huggingface_hub")
    import mpack.convert as mc
    from mpack.fixtures import make_checkpoint
    from tests.convert.hf_cache import add_repo

    root = tmp_path_factory.mktemp("doc-examples").resolve()
    ck = make_checkpoint(root / "ckpt")
    files = {p.name: p.read_bytes() for p in sorted(ck.iterdir())}
    repos = sorted(
        {
            tok
            for b in RUNNABLE
            if RUNS[b.lang] == "sh"
            for args in mpack_commands(b.text)
            for tok in args
            if HUB_ID.fullmatch(tok) and not tok.startswith(".")
        }
    )
    assert "RedHatAI/Meta-Llama-3.1-8B-Instruct-FP8" in repos, repos
    for repo in repos:
        add_repo(root / "hf" / "hub", repo, files, COMMIT, ["main"])
    mc.convert(ck, root / SIDECAR, tp=2, device="cpu")
    for d in ("home", "cache", "rt"):
        (root / d).mkdir(mode=0o700)
    bindir = Path(sys.executable).parent
    assert (bindir / "mpack").is_file(), f"no mpack script beside {sys.executable}"
    # As a user runs them: no MPACK_* switches (the verdict cache on, in the private cache), no
    # Hub token, and nothing of this machine's HF or XDG folders.
    skip = ("HF_", "HUGGING_FACE_", "MPACK_", "XDG_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(skip)}
    env.update(
        PATH=f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}",
        HOME=str(root / "home"),
        XDG_CACHE_HOME=str(root / "cache"),
        XDG_RUNTIME_DIR=str(root / "rt"),
        HF_HOME=str(root / "hf"),
        HF_HUB_CACHE=str(root / "hf" / "hub"),
        HF_HUB_OFFLINE="1",
        HF_HUB_DISABLE_TELEMETRY="1",
        HF_ENDPOINT="http://127.0.0.1:9",  # nothing listens there: a request fails at once
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
    )
    return {"root": root, "ckpt": ck, "env": env, "n": [0]}


def run_block(world: dict[str, Any], lang: str, text: str) -> subprocess.CompletedProcess:
    """Run one block in a fresh directory (see the module docstring); its own process group,
    killed afterwards, so a daemon it leaves behind does not outlive it."""
    world["n"][0] += 1
    ws = world["root"] / f"ws-{world['n'][0]}"
    ws.mkdir()
    shutil.copytree(world["ckpt"], ws / CHECKPOINT)
    writes_sidecar = re.search(rf"(?:-o|--out)\s+{SIDECAR}\b", text)
    if SIDECAR in text and not writes_sidecar:
        shutil.copytree(world["root"] / SIDECAR, ws / SIDECAR)
    script = ws / ("example.sh" if RUNS[lang] == "sh" else "example.py")
    script.write_text(text)
    cmd = ["bash", "-e", script.name] if RUNS[lang] == "sh" else [sys.executable, script.name]
    proc = subprocess.Popen(
        cmd,
        cwd=ws,
        env=world["env"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=180)
    finally:
        with contextlib.suppress(ProcessLookupError):  # the group is gone already
            os.killpg(proc.pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.wait()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _tail(s: str, n: int = 3000) -> str:
    return s if len(s) <= n else "..." + s[-n:]


@pytest.mark.slow
@pytest.mark.parametrize("block", RUNNABLE, ids=[b.where for b in RUNNABLE])
def test_example_runs(world: dict[str, Any], block: Block) -> None:
    r = run_block(world, block.lang, block.text)
    assert r.returncode == 0, (
        f"{block.where}: the example exits {r.returncode}\n{block.text}"
        f"--- stdout\n{_tail(r.stdout)}\n--- stderr\n{_tail(r.stderr)}"
    )
    assert "Traceback" not in r.stderr, f"{block.where}\n{_tail(r.stderr)}"


@pytest.mark.slow
def test_a_failing_line_fails_its_block(world: dict[str, Any]) -> None:
    """``set -e``: a command that fails stops the block, and the block fails."""
    r = run_block(world, "", f"mpack inspect {CHECKPOINT}-missing\necho after\n")
    assert r.returncode == 2, r.stderr
    assert "after" not in r.stdout


@pytest.mark.slow
def test_the_minimal_client_of_runtime_md_attaches(world: dict[str, Any]) -> None:
    """docs/RUNTIME.md's stdlib client does the attach handshake with a real daemon."""
    from mpack.runtime.spawn import spawn
    from mpack.sidecar import load_manifest

    (block,) = [b for b in RUNNABLE if "def mpack_attach" in b.text]
    ns: dict[str, Any] = {}
    exec(compile(block.text, block.where, "exec"), ns)
    sidecar = world["root"] / SIDECAR
    _, digest = load_manifest(sidecar)
    with spawn(sidecar, rank=1, device="cpu", env=world["env"], cwd=world["root"]) as daemon:
        s, reply, fds = ns["mpack_attach"](str(daemon.ready.socket), digest, 1, "cpu")
        try:
            assert reply["type"] == "attached", reply
            assert (reply["digest"], reply["rank"], reply["backend"]) == (digest, 1, "host")
            assert len(fds) == 1 and os.fstat(fds[0]).st_size >= reply["data_size"] > 0
        finally:
            for fd in fds:
                os.close(fd)
            s.close()
