"""scripts/vllm_serve.py's account of a `vllm serve` start (issue 40 item 5), on the logs of a
real run (docs/bench/serve-h100-2026-12-06: vLLM 0.33.0 on an H100): every line vLLM prints that
marks a part is found, the parts add up to the time to the first completion, and a weight-cache
engine that fell back to the disk is told apart from one that mapped the daemon's weights."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "docs" / "bench" / "serve-h100-2026-12-06"
sys.path.insert(0, str(ROOT / "scripts"))

import vllm_serve  # noqa: E402


def test_every_part_of_an_answered_start_is_found_and_they_add_up() -> None:
    rec = json.loads((RUN / "serve-starts.json").read_text())
    answered = {k: v for k, v in rec.items() if isinstance(v, dict) and "first_completion_s" in v}
    assert {"ordinary", "ordinary-cold", "attached-cold", "fastsafetensors"} <= set(answered)
    for start in ("ordinary", "ordinary-cold", "attached-cold", "fastsafetensors", "private"):
        got = vllm_serve.parts(
            vllm_serve.marks_of_log(RUN / f"serve-{start}.log"),
            answered[start]["first_completion_s"],
        )
        assert list(got["parts"]) == [name for name, _, _ in vllm_serve.PARTS], start
        assert all(v >= 0 for v in got["parts"].values()), (start, got["parts"])
        total = sum(got["parts"].values())
        assert abs(total - answered[start]["first_completion_s"]) < 0.01, (start, total)
        # vLLM's own load figure lies inside the load part's wall time, give or take its log
        assert got["parts"]["load"] <= got["vllm"]["load"] + 0.01, start
        assert got["compile_cache"] in ("hit", "miss"), start


def test_an_attached_start_shows_mpacks_lines() -> None:
    marks = vllm_serve.marks_of_log(RUN / "serve-attached-cold.log")
    at = {k: v["at_s"] for k, v in marks.items()}
    assert at["load_start"] <= at["mpack_attach"] <= at["mpack_passthrough"] <= at["load"]
    assert "weights" not in marks  # vLLM read no checkpoint shard


def test_the_table_is_printed_from_the_logs() -> None:
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "vllm_serve.py"), "--table",
         str(RUN / "serve-starts.json"), "--logs", str(RUN)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    rows = [line for line in r.stdout.splitlines() if line.startswith("| ordinary-cold |")]
    assert len(rows) == 1
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    assert cells[1] == "104.9" and cells[-3] == "12.84" and cells[-2] == "hit"


def test_a_weight_cache_engine_is_told_from_one_that_read_the_disk() -> None:
    mapped: dict[str, dict[str, float]] = {}
    fell: dict[str, dict[str, float]] = {}
    vllm_serve.see_line(mapped, 3.0, "INFO [ipc_loader.py:321] Mapped 291 tensors from the "
                        "weight cache daemon (zero_copy mode)")  # fmt: skip
    vllm_serve.see_line(fell, 3.0, "WARNING [ipc_loader.py:252] Weight cache unusable (key "
                        "mismatch); falling back to disk loading")  # fmt: skip
    assert mapped["ipc_mapped"]["vllm"] == 291 and "ipc_fallback" not in mapped
    assert "ipc_fallback" in fell and "ipc_mapped" not in fell
