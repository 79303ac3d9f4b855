"""What the benchmark reports: one ``Row`` per measurement against its peer and its target, the
figures issue 15 started from (``BEFORE``), the machine, the table (printed last) and the
Markdown record appended by ``--md``.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: Row key -> (limit, what the limit is on). A limit on ``x PEER`` is checked on value / peer,
#: any other on the value itself, in the row's unit, peer or not (``first-attach-*``, ``serve-*``
#: show their peer's ratio beside an absolute target). Keys: see ``rows`` and ``runtime_rows``
#: (``convert-cpu-16c``: 16 cores; ``-check``: no kept scheme verdict, the targets of the row
#: without; ``first-attach-cuda-8``: 8 clients at once; ``-nowarm``: no ``mpack.runtime.warm``
#: first, the same targets: issue 28's limits are on a process's first attach, however it
#: started). ``serve-cpu`` has none: issue 28's 2.5 s is for the 8B sidecar on the H200.
TARGETS: dict[str, tuple[float, str]] = {
    "convert-cuda": (1.1, "x cp -r"),
    "convert-cuda-cold": (1.3, "x cp -r cold"),
    "convert-cpu-16c": (1.3, "x cp -r"),
    "convert-cpu-4c": (2.0, "x cp -r"),
    "convert-cpu-4c-hub": (2.0, "x cp -r"),
    "convert-cpu-4c-hub-check": (2.0, "x cp -r"),
    "convert-cpu-4c-check": (2.0, "x cp -r"),
    "convert-cuda-cold-check": (1.3, "x cp -r cold"),
    "verify": (1.5, "x cp -r"),
    "load-cuda": (0.9, "x load_file"),
    "load-cpu": (0.9, "x load_file"),
    "load-cuda-cold": (1.1, "x disk read"),
    "load-cpu-cold": (1.1, "x disk read"),
    "attach-1": (20.0, "ms"),
    "attach-8": (30.0, "ms each"),
    "first-attach-cuda-1": (10.0, "ms"),
    "first-attach-cuda-1-nowarm": (10.0, "ms"),
    "first-attach-cuda-8": (15.0, "ms each"),
    "first-attach-cuda-8-nowarm": (15.0, "ms each"),
    "first-attach-cpu-1": (5.0, "ms"),
    "first-attach-cpu-1-nowarm": (5.0, "ms"),
    "serve-cuda": (2.5, "s"),
    "convert-cpu-2c-rounds": (1.5, "x cp -r && sync"),
    "convert-cpu-2c-hub-rounds": (1.5, "x cp -r && sync"),
    "rss": (1.25, "x (size-independent)"),
}

#: Issue 15's figures (the H200 machine, 8B-shaped checkpoint), per row key.
BEFORE: dict[str, str] = {
    "convert-cuda": "12.6 s, 1.32x cp -r (9.5 s)",
    "convert-cpu-16c": "14.2 s, 1.49x cp -r",
    "convert-cuda-cold": "24.8 s, 2.49x cp -r cold (9.9 s)",
    "verify": "41.5 s, 4.36x cp -r",
    "load-cuda": "2.38 s, 1.09x load_file (2.19 s)",
    "attach-1": "60-80 ms",
    "attach-8": "up to 137 ms",
}

COLUMNS = ("what", "now", "peer", "ratio", "target", "met?", "before (issue 15)")


@dataclass
class Row:
    """One line of the table. ``value``: what the target checks, in ``unit`` (s, ms, GiB);
    ``peer``: the peer's figure in the same unit (None: the target is on ``value`` itself);
    ``peer2``: a second peer (``cp -r`` + ``sync``), shown beside the first."""

    key: str
    what: str
    value: float | None = None
    unit: str = "s"
    now: str = ""
    peer: float | None = None
    peer_text: str = "-"
    peer2: float | None = None
    notes: list[str] = field(default_factory=list)
    runs: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    @property
    def ratio(self) -> float | None:
        return self.value / self.peer if self.value is not None and self.peer else None

    @property
    def met(self) -> bool | None:
        if self.key not in TARGETS or self.value is None:
            return None
        limit, on = TARGETS[self.key]
        got = self.ratio if on.startswith("x") else self.value
        return None if got is None else got <= limit

    def cells(self) -> list[str]:
        if self.error is not None:
            return [self.what, "FAILED", "-", "-", self.target_text(), "-", self.before()]
        ratio = "-" if self.ratio is None else f"{self.ratio:.2f}x"
        if self.ratio is not None and self.peer2 and self.value is not None:
            ratio += f" ({self.value / self.peer2:.2f}x + sync)"
        met = {None: "-", True: "yes", False: "NO"}[self.met]
        return [self.what, self.now, self.peer_text, ratio, self.target_text(), met, self.before()]

    def target_text(self) -> str:
        if self.key not in TARGETS:
            return "-"
        limit, on = TARGETS[self.key]
        return f"<= {limit:g}{on}" if on.startswith("x") else f"<= {limit:g} {on}"

    def before(self) -> str:
        return BEFORE.get(self.key, "-")

    def to_json(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items()}
        d.update(ratio=self.ratio, met=self.met, target=TARGETS.get(self.key), before=self.before())
        return d


def secs(x: float) -> str:
    return f"{x:.2f} s"


# --- the table -----------------------------------------------------------------------------------


def print_table(rows: list[Row], lines: list[str]) -> None:
    """The table, columns padded; then each row's notes and the run's own lines (skips,
    warnings)."""
    cells = [list(COLUMNS), *(r.cells() for r in rows)]
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    print()
    for i, c in enumerate(cells):
        print("  ".join(x.ljust(w) for x, w in zip(c, widths, strict=True)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))
    for line in notes_of(rows) + lines:
        print(f"- {line}")


def notes_of(rows: list[Row]) -> list[str]:
    out = []
    for r in rows:
        out += [f"{r.what}: {n}" for n in r.notes]
        if r.error is not None:
            out.append(f"{r.what}: FAILED: {r.error.splitlines()[0] if r.error else ''}")
    return out


def markdown(rows: list[Row], lines: list[str], meta: dict[str, Any]) -> str:
    """The run as a Markdown subsection: machine, command, table, notes."""
    m = meta["machine"]
    gpu = f"{m['gpu']} (driver {m.get('driver') or '?'})" if m.get("gpu") else "no GPU"
    head = [
        f"### {m['date']}, {m.get('gpu') or 'no GPU'}",
        "",
        f"Machine: {gpu}, torch {m.get('torch')}, {m['cpus']} CPUs "
        f"({m.get('cpu_model') or '?'}), Python {m['python']}; "
        f"git {m['commit']}. Checkpoint: {meta['layers']} layers, "
        f"{meta['source_bytes'] / 1e9:.2f} GB"
        + (f"; sidecar {meta['sidecar_bytes'] / 1e9:.2f} GB" if meta.get("sidecar_bytes") else "")
        + ".",
        "",
        f"Command: `{meta['command']}`",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "| " + " | ".join("---" for _ in COLUMNS) + " |",
    ]
    body = ["| " + " | ".join(c.replace("|", "\\|") for c in r.cells()) + " |" for r in rows]
    tail = [f"- {line}" for line in notes_of(rows) + lines]
    return "\n".join([*head, *body, "", *tail, ""])


def append_markdown(path: Path, text: str) -> None:
    """Append ``text`` to ``path`` under the section "bench_vs_tools runs" (made if missing)."""
    old = path.read_text() if path.exists() else ""
    section = "## bench_vs_tools runs"
    lead = (
        ""
        if section in old
        else f"{section}\n\n`python scripts/bench_vs_tools.py --md FILE` "
        "appends one subsection per run.\n\n"
    )
    sep = "" if not old or old.endswith("\n\n") else "\n" if old.endswith("\n") else "\n\n"
    with open(path, "a") as f:
        f.write(sep + lead + text)


# --- the machine ---------------------------------------------------------------------------------

PROBE = (
    "import json, torch; ok = torch.cuda.is_available(); print(json.dumps({'torch': "
    "torch.__version__, 'torch_cuda': torch.version.cuda, 'cuda': ok, 'gpu': "
    "torch.cuda.get_device_name(0) if ok else None}))"
)


def machine(env: dict[str, str], cwd: Path) -> dict[str, Any]:
    """GPU (name, driver), torch, CPUs, date (UTC), git commit of this checkout; ``cuda``: whether
    torch sees a GPU (asked in a fresh process: this one never imports torch)."""
    m: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "commit": git_commit(),
    }
    with contextlib.suppress(OSError):
        models = [
            x for x in Path("/proc/cpuinfo").read_text().splitlines() if x.startswith("model name")
        ]
        m["cpu_model"] = models[0].split(":", 1)[1].strip() if models else None
    r = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, cwd=cwd
    )
    m.update(json.loads(r.stdout) if r.returncode == 0 else {"cuda": False, "torch": None})
    if m["cuda"] and shutil.which("nvidia-smi"):
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            q = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", "-i", "0"]
            m["driver"] = subprocess.run(
                q, capture_output=True, text=True, timeout=30
            ).stdout.strip()
    return m


def git_commit() -> str:
    """$BENCH_COMMIT when set (a copy of the tree whose .git, if any, is not the checkout's: the
    device machine's); else this checkout's commit (``+ changes`` when the tree differs from
    it); else ``unknown``."""
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    repo = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if head.returncode == 0:
            dirty = subprocess.run(["git", "-C", str(repo), "diff", "--quiet", "HEAD"], timeout=60)
            return head.stdout.strip() + (" + changes" if dirty.returncode else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"
