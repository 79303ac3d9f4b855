#!/usr/bin/env python3
"""Repack throughput for the Llama-3.1-8B linear shapes: fused kernel vs torch ops vs a copy.

GPU (one layer of each shape, CUDA events, warmup, median of --reps timings; each timing covers
--inner back-to-back calls queued behind a GPU sleep, so host launch overhead is not counted):
  (a) the fused kernel, ``mpack.convert.cuda_repack.pack_weight_cuda``;
  (b) the torch-op path, ``mpack.convert.marlin.pack_weight`` on CUDA tensors;
  (c) a device-to-device copy of the same N*K bytes, ``dst.copy_(src)``.
CPU (one layer of each shape, wall clock, median): the native host repack on one thread
(``host_repack.pack_rows`` into a fresh array, and into a used one), the torch-op path
(``marlin.pack_weight`` with ``MPACK_NO_HOST_REPACK=1``, on torch's threads) and ``clone()``.
The 32-layer totals are the per-shape times summed and multiplied by 32 (6.98 GB of fp8).

Bandwidth counts the bytes an ideal pass moves: the repack reads N*K and writes Np*Kp; the copy
reads and writes N*K. The ratio table comes last.

``--kernels tile,rows:16,rows:0``: only the native repack on one thread into a used array, per
shape, for each kernel of the extension (Note [tile kernel]): ``tile`` (SSE2, whole tiles) or
``rows:B``, the row kernel with ``host_repack.K_BLOCK = B`` (k-tiles per pass over an n-tile's
rows; 0: whole rows), in GB/s of fp8 input. ``--k-blocks 0,8,16`` is ``--kernels
rows:0,rows:8,rows:16``.

usage: python scripts/bench_repack.py [--cpu-only | --cpu-sweep | --kernels K,K,... |
    --k-blocks B,B,...] [--json PATH] [--reps N] [--warmup N]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import torch

REPO = Path(__file__).resolve().parents[1]
# An installed mpack may not ship cuda/; the kernel source of this checkout is the one to time.
if (REPO / "cuda" / "marlin_repack.cu").is_file():
    os.environ.setdefault("MPACK_REPACK_SOURCE", str(REPO / "cuda" / "marlin_repack.cu"))

from mpack.convert import cuda_repack, host_repack, marlin  # noqa: E402

#: One Llama-3.1-8B decoder layer's fused linears, [N, K].
SHAPES: list[tuple[str, int, int]] = [
    ("qkv_proj", 6144, 4096),
    ("o_proj", 4096, 4096),
    ("gate_up_proj", 28672, 4096),
    ("down_proj", 4096, 14336),
]
LAYERS = 32
#: vLLM 0.33.0's in-engine Marlin prep of the same 8B-shaped linears, measured on an H200.
VLLM_REF = {"vllm_prep_ms": 74.0, "d2d_clone_ms": 3.9, "ratio": 19.0, "bytes": 6.98e9}


def _fp8_bytes_total() -> int:
    return LAYERS * sum(n * k for _, n, k in SHAPES)


def _rand_u8(n: int, k: int, device: str) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(n * 31 + k)
    return torch.randint(0, 256, (n, k), dtype=torch.uint8, device=device, generator=g)


# --- GPU ---------------------------------------------------------------------------------------


def gpu_time_ms(fn: Callable[[], Any], reps: int, warmup: int, inner: int) -> float:
    """Median GPU time of one ``fn()`` call in ms (CUDA events around ``inner`` queued calls)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    host_s = time.perf_counter() - t0  # host time to queue `inner` calls
    torch.cuda.synchronize()
    # Sleep long enough (at <= 2 GHz) for the host to queue the timed calls behind it.
    cycles = int(min(max(4 * host_s, 1e-4), 0.05) * 2e9)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        torch.cuda._sleep(cycles)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / inner)
    return statistics.median(times)


def _gpu_shape(
    name: str, n: int, k: int, kernel_ok: bool, reps: int, warmup: int, inner: int
) -> dict[str, Any]:
    """One layer shape on the GPU: kernel, torch ops and copy timings (ms) and byte counts."""
    np_, kp = marlin.marlin_padded_nk(n, k)
    src = _rand_u8(n, k, "cuda")
    dst = torch.empty_like(src)
    row: dict[str, Any] = {"name": name, "n": n, "k": k, "np": np_, "kp": kp}
    row["bytes_repack"] = n * k + np_ * kp
    row["bytes_copy"] = 2 * n * k
    row["torch_ms"] = gpu_time_ms(lambda: marlin.pack_weight(src, np_, kp), reps, warmup, inner)
    row["copy_ms"] = gpu_time_ms(lambda: dst.copy_(src), reps, warmup, inner)
    if kernel_ok:
        got = cuda_repack.pack_weight_cuda(src, np_, kp)
        row["kernel_bytes_identical"] = torch.equal(got, marlin.pack_weight(src, np_, kp))
        del got
        row["kernel_ms"] = gpu_time_ms(
            lambda: cuda_repack.pack_weight_cuda(src, np_, kp), reps, warmup, inner
        )
    return row


def bench_gpu(reps: int, warmup: int, inner: int) -> dict[str, Any]:
    """Every layer shape on the current CUDA device, and the 32-layer totals."""
    kernel_ok = cuda_repack.available()
    res: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "kernel_available": kernel_ok,
        "kernel_unavailable_reason": None if kernel_ok else cuda_repack.unavailable_reason(),
        "shapes": [_gpu_shape(name, n, k, kernel_ok, reps, warmup, inner) for name, n, k in SHAPES],
    }
    torch.cuda.empty_cache()
    res["total"] = _totals(res["shapes"], ("kernel_ms", "torch_ms", "copy_ms"))
    return res


# --- CPU ---------------------------------------------------------------------------------------


def cpu_time_ms(fn: Callable[[], Any], reps: int, warmup: int) -> float:
    """Median wall-clock time of one ``fn()`` call in ms."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _cpu_shape(name: str, n: int, k: int, reps: int, warmup: int) -> dict[str, Any]:
    """One layer shape on the CPU: torch-op repack and clone() timings (ms) and byte counts."""
    np_, kp = marlin.marlin_padded_nk(n, k)
    src = _rand_u8(n, k, "cpu")
    row: dict[str, Any] = {"name": name, "n": n, "k": k, "np": np_, "kp": kp}
    row["bytes_repack"] = n * k + np_ * kp
    row["bytes_copy"] = 2 * n * k
    with mock.patch.dict(os.environ, {"MPACK_NO_HOST_REPACK": "1"}):  # the torch ops
        row["torch_ms"] = cpu_time_ms(lambda: marlin.pack_weight(src, np_, kp), reps, warmup)
    if host_repack.available():
        rows = host_repack.rows_of(src.numpy())
        used = host_repack.pack_rows(rows, k, np_, kp)
        row["native_ms"] = cpu_time_ms(
            lambda: host_repack.pack_rows(rows, k, np_, kp), reps, warmup
        )
        row["native_used_ms"] = cpu_time_ms(
            lambda: host_repack.pack_rows(rows, k, np_, kp, out=used), reps, warmup
        )
    row["copy_ms"] = cpu_time_ms(src.clone, reps, warmup)
    return row


def bench_cpu(reps: int, warmup: int) -> dict[str, Any]:
    """Every layer shape on the CPU, and the 32-layer totals."""
    res: dict[str, Any] = {
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "shapes": [_cpu_shape(name, n, k, reps, warmup) for name, n, k in SHAPES],
    }
    keys = ("torch_ms", "copy_ms") + (
        ("native_ms", "native_used_ms") if host_repack.available() else ()
    )
    res["total"] = _totals(res["shapes"], keys)
    return res


def kernels(names: list[str], reps: int) -> dict[str, dict[str, float]]:
    """GB/s of fp8 input of the native repack per shape (one thread, a used output array) for
    each kernel, ``tile`` or ``rows:B`` (the row kernel in blocks of B k-tiles): ``{name:
    {shape name: GB/s}}``."""
    out: dict[str, dict[str, float]] = {}
    for name in names:
        kernel, _, kb = name.partition(":")
        with (
            mock.patch.object(host_repack, "KERNEL", kernel),
            mock.patch.object(host_repack, "K_BLOCK", int(kb or host_repack.K_BLOCK)),
        ):
            row = {}
            for shape, n, k in SHAPES:
                np_, kp = marlin.marlin_padded_nk(n, k)
                src = _rand_u8(n, k, "cpu").numpy()  # alive while its row addresses are used
                rows = host_repack.rows_of(src)
                used = host_repack.pack_rows(rows, k, np_, kp)
                call = functools.partial(host_repack.pack_rows, rows, k, np_, kp, out=used)
                row[shape] = round(n * k / cpu_time_ms(call, reps, 1) / 1e6, 2)
        out[name] = row
        print(f"{name:>8}: " + ", ".join(f"{s} {v} GB/s" for s, v in row.items()), flush=True)
    return out


def sweep_cpu(reps: int, loads: tuple[int, ...] = (0, 8)) -> list[dict[str, Any]]:
    """``marlin.repack`` over one 8B decoder layer (the four shapes) for several block sizes
    (Note [repack in blocks]), with torch's own threads ("omp": one op at a time on every core)
    or a pool of threads each running torch ops on one thread ("pool", what convert uses), alone
    and next to ``load`` threads hashing memory with sha256 (what a conversion's hashing and
    writing threads do meanwhile)."""
    import hashlib
    import threading

    layers = [_rand_u8(n, k, "cpu") for _, n, k in SHAPES]
    nbytes = sum(w.numel() for w in layers)
    cores, saved = os.cpu_count() or 1, (torch.get_num_threads(), marlin.REPACK_BLOCK_BYTES)
    configs = [("omp", cores, b) for b in (1 << 20, 1 << 40)] + [
        ("pool", w, b)
        for w in sorted({host_repack.block_workers(), max(1, cores // 2), cores}, reverse=True)
        for b in (1 << 18, 1 << 20, 1 << 22)
    ]
    rows = []
    for load in loads:
        stop = threading.Event()
        blob = os.urandom(16 * 1024 * 1024)

        def burn(stop: threading.Event = stop, blob: bytes = blob) -> None:
            while not stop.is_set():
                hashlib.sha256(blob).digest()

        burners = [threading.Thread(target=burn, daemon=True) for _ in range(load)]
        for t in burners:
            t.start()
        try:
            for mode, threads, block in configs:
                marlin.REPACK_BLOCK_BYTES = block
                with (
                    host_repack.block_pool(threads)
                    if mode == "pool"
                    else contextlib.nullcontext() as pool
                ):
                    torch.set_num_threads(threads if mode == "omp" else saved[0])
                    ms = sum(
                        cpu_time_ms(lambda w=w: marlin.repack(w, pool), reps, 1) for w in layers
                    )
                row = {
                    "load": load,
                    "mode": mode,
                    "threads": threads,
                    "block": block,
                    "ms": ms,
                    "gbps": nbytes / ms / 1e6,
                }
                rows.append(row)
                print(
                    f"load {load:>2}  {mode:<4} threads {threads:>3}  block "
                    f"{'whole' if block >= 1 << 40 else f'{block >> 10} KiB':>9}  "
                    f"{ms:8.1f} ms  {row['gbps']:6.2f} GB/s",
                    flush=True,
                )
        finally:
            stop.set()
            for t in burners:
                t.join()
            torch.set_num_threads(saved[0])
            marlin.REPACK_BLOCK_BYTES = saved[1]
    return rows


# --- report ------------------------------------------------------------------------------------


def _totals(rows: list[dict[str, Any]], keys: tuple[str, ...]) -> dict[str, Any]:
    """Per-shape values summed over one layer and multiplied by LAYERS; GB/s per column."""
    tot: dict[str, Any] = {
        "layers": LAYERS,
        "fp8_bytes": _fp8_bytes_total(),
        "bytes_repack": LAYERS * sum(r["bytes_repack"] for r in rows),
        "bytes_copy": LAYERS * sum(r["bytes_copy"] for r in rows),
    }
    for key in keys:
        if all(key in r for r in rows):
            tot[key] = LAYERS * sum(r[key] for r in rows)
    for r in [*rows, tot]:
        for key in keys:
            if key in r:
                nbytes = r["bytes_copy"] if key == "copy_ms" else r["bytes_repack"]
                r[key.replace("_ms", "_gbps")] = nbytes / (r[key] * 1e-3) / 1e9
    return tot


def _fmt(r: dict[str, Any], key: str) -> str:
    if key not in r:
        return f"{'-':>9} {'-':>8}"
    return f"{r[key]:9.3f} {r[key.replace('_ms', '_gbps')]:8.1f}"


def print_table(title: str, part: dict[str, Any], cols: list[tuple[str, str]]) -> None:
    print(f"\n{title}")
    head = "".join(f" {label + ' ms':>9} {'GB/s':>8}" for label, _ in cols)
    print(f"{'layer':<14}{'N x K':>14}{'Np x Kp':>14}{head}")
    for r in part["shapes"]:
        cells = "".join(f" {_fmt(r, key)}" for _, key in cols)
        print(f"{r['name']:<14}{r['n']:>7}x{r['k']:<6}{r['np']:>7}x{r['kp']:<6}{cells}")
    t = part["total"]
    cells = "".join(f" {_fmt(t, key)}" for _, key in cols)
    label, size = f"x{LAYERS} layers", f"{t['fp8_bytes'] / 1e9:.2f} GB fp8"
    print(f"{label:<14}{size:>28}{cells}")


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:8.2f}" if a is not None and b else f"{'-':>8}"


def print_ratios(results: dict[str, Any]) -> None:
    ref = VLLM_REF
    print(
        f"\nreference: vLLM 0.33.0 in-engine Marlin prep of the same 8B linears: "
        f"{ref['vllm_prep_ms']:.0f} ms on an H200 = {ref['ratio']:.0f}x a plain D2D clone of "
        f"the {ref['bytes'] / 1e9:.2f} GB ({ref['d2d_clone_ms']} ms)"
    )
    print("\nratios (per layer shape, then the 32-layer total)")
    rows: list[tuple[str, Callable[[dict[str, Any]], str]]] = []
    gpu, cpu = results.get("gpu"), results.get("cpu")
    if gpu:
        rows += [
            ("GPU kernel/copy bandwidth", lambda r: _ratio(r.get("kernel_gbps"), r["copy_gbps"])),
            ("GPU kernel time / copy time", lambda r: _ratio(r.get("kernel_ms"), r["copy_ms"])),
            ("GPU torch-op time / copy time", lambda r: _ratio(r["torch_ms"], r["copy_ms"])),
            ("GPU torch-op / kernel time", lambda r: _ratio(r["torch_ms"], r.get("kernel_ms"))),
        ]
    if cpu:
        rows += [
            ("CPU torch-op/clone bandwidth", lambda r: _ratio(r["torch_gbps"], r["copy_gbps"])),
            ("CPU torch-op time / clone", lambda r: _ratio(r["torch_ms"], r["copy_ms"])),
        ]
        if "native_ms" in cpu["total"]:
            rows += [
                ("CPU native time / clone", lambda r: _ratio(r["native_ms"], r["copy_ms"])),
                ("CPU native (used) / clone", lambda r: _ratio(r["native_used_ms"], r["copy_ms"])),
                ("CPU torch-op / native time", lambda r: _ratio(r["torch_ms"], r["native_ms"])),
            ]
    names = [s[0] for s in SHAPES] + [f"x{LAYERS}"]
    print(f"{'':<31}" + "".join(f"{n[:8]:>9}" for n in names))
    for label, f in rows:
        part = gpu if label.startswith("GPU") else cpu
        assert part is not None
        print(f"{label:<31}" + "".join(f" {f(r)}" for r in [*part["shapes"], part["total"]]))
    if gpu and "kernel_ms" in gpu["total"]:
        k_ms = gpu["total"]["kernel_ms"]
        print(
            f"GPU 32-layer repack: kernel {k_ms:.2f} ms, torch ops {gpu['total']['torch_ms']:.2f}"
            f" ms, copy {gpu['total']['copy_ms']:.2f} ms; vLLM prep {ref['vllm_prep_ms']:.0f} ms"
            f" = {ref['vllm_prep_ms'] / k_ms:.1f}x the kernel; kernel = "
            f"{k_ms / gpu['total']['copy_ms']:.2f}x our copy (vLLM prep: {ref['ratio']:.0f}x clone)"
        )
    elif gpu:
        print(f"GPU kernel not timed: {gpu['kernel_unavailable_reason']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu-only", action="store_true", help="only the CPU part (no GPU needed)")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--reps", type=int, default=20, help="GPU timings per case (median)")
    ap.add_argument("--warmup", type=int, default=3, help="GPU warmup calls per case")
    ap.add_argument("--inner", type=int, default=5, help="GPU calls per timing")
    ap.add_argument("--cpu-reps", type=int, default=5, help="CPU timings per case (median)")
    ap.add_argument(
        "--cpu-sweep", action="store_true", help="only: CPU block size x threads x load sweep"
    )
    ap.add_argument("--kernels", help="only: the native repack per kernel, e.g. tile,rows:16")
    ap.add_argument("--k-blocks", help="only: the row kernel per K_BLOCK, e.g. 0,8,16,32")
    args = ap.parse_args(argv)
    if args.kernels or args.k_blocks:
        if not host_repack.available():
            ap.error("--kernels needs the native repack (host_repack.available() is False)")
        names = args.kernels.split(",") if args.kernels else []
        names += [f"rows:{int(b)}" for b in args.k_blocks.split(",")] if args.k_blocks else []
        if "tile" in names and host_repack.KERNEL != "tile":
            ap.error("the tile kernel is not built here (host_repack.KERNEL is 'rows')")
        got = kernels(names, args.cpu_reps)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"kernels": got}, indent=2) + "\n")
        return 0
    if args.cpu_sweep:
        rows = sweep_cpu(max(1, args.cpu_reps // 2))
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"cpu_sweep": rows}, indent=2) + "\n")
        return 0

    results: dict[str, Any] = {
        "meta": {
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "python": platform.python_version(),
            "shapes": SHAPES,
            "layers": LAYERS,
            "reps": args.reps,
            "inner": args.inner,
            "cpu_reps": args.cpu_reps,
        },
        "reference": VLLM_REF,
    }
    if not args.cpu_only:
        if not torch.cuda.is_available():
            print("no CUDA device: run with --cpu-only", file=sys.stderr)
            return 2
        results["gpu"] = bench_gpu(args.reps, args.warmup, args.inner)
    results["cpu"] = bench_cpu(args.cpu_reps, 1)

    if "gpu" in results:
        gpu = results["gpu"]
        same = all(r.get("kernel_bytes_identical", True) for r in gpu["shapes"])
        print_table(
            f"GPU: {gpu['device']}, torch {torch.__version__}; median of {args.reps} x "
            f"{args.inner} calls; kernel bytes identical to the torch path: {same}",
            gpu,
            [("kernel", "kernel_ms"), ("torch", "torch_ms"), ("copy", "copy_ms")],
        )
    cpu = results["cpu"]
    print_table(
        f"CPU: {cpu['cpu']}, {cpu['threads']} torch threads; median of {args.cpu_reps}",
        cpu,
        [
            ("torch", "torch_ms"),
            ("native", "native_ms"),
            ("native, used", "native_used_ms"),
            ("clone", "copy_ms"),
        ],
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
        print(f"\nresults written to {args.json}")
    print_ratios(results)  # last
    return 0


if __name__ == "__main__":
    sys.exit(main())
