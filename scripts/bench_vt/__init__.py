"""The parts of scripts/bench_vs_tools.py (its docstring says what it measures and how):
``rows`` (the run: the peers and every row), ``workers`` (the measuring processes),
``report`` (targets, the figures before, the table, the Markdown record)."""
