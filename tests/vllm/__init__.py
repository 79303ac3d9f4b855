"""The vLLM loader on vLLM's real classes, on the CPU (run with .venv-vllm: Makefile)."""
