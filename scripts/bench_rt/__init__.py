"""The parts of scripts/bench_runtime.py (its docstring says what it measures and how)."""

MiB = 1024 * 1024
GB = 1e9
