"""Prepare ``.vllmdev/`` for scripts/device_vllm.sh (its ``--pack``): vLLM 0.33.0 in two calls.

One device call carries at most 64 MiB, the working tree included (about 17 MiB, most of it
tests/data/golden). vLLM's Python files, the wheels its import needs and its compiled ops
(``_C_stable_libtorch.abi3.so``, 88 MiB, 60 MiB as xz) do not fit in one, so they travel in two:

- call 1 (PHASE=1): ``.vllmdev/vllm-py.tar.xz``, ``.vllmdev/w/*.whl``, ``.vllmdev/p1/part00``
  and ``.vllmdev/so.sha256``;
- call 2 (PHASE=2): ``.vllmdev/p2/part01``.

The wheels of mpack's environment (``.device/wheels``) that call 1 does not already carry in
``w/`` (those are listed in ``w/msite.txt``, and call 1 installs them into mpack's environment
too) go in ``.vllmdev/mw/``, carried by the call PHASE=fa with FlashAttention 3 (``.vllmdev/fa``):
with them in call 2, the two calls came to 66 MiB.

The two parts are the xz of the .so cut in two, at the byte that leaves both calls the same room.
Everything is checked against the wheel's RECORD, and each call's size is printed; a call over
``--limit-mib`` (60: room for the tree to grow) is refused, exit 3.

What is left out of vllm-py.tar.xz, and why:

- the compiled extensions (``*.so``): ``_C_stable_libtorch`` travels in the parts; the
  flash-attention ones (480 MB) are replaced by scripts/vllm_fa_standin.py; the others (MoE,
  MLA, DeepGEMM, ...) are for models and kernels the comparison does not use, and vLLM imports
  them only where it needs them (the small ``cumem_allocator``, ``spinloop`` and ``fs_io_C``
  also stay behind: vLLM takes their absence as "not available", where a present one that fails
  to load would stop the import);
- ``vllm/vllm-rs`` (a 58 MiB program, not Python);
- C, C++ and CUDA sources and headers (``third_party``'s CUTLASS and DeepGEMM): compiled at run
  time only for kernels the comparison does not use.

The wheels are those of ``DEVICE_LACKS`` at the versions of constraints-vllm.txt (the venv the
CPU suite runs vLLM in), for CPython 3.12 on x86-64 Linux. Each is stored again with LZMA instead
of deflate: the same files and RECORD (its hashes are of the files, not of the archive), pip
installs it the same way, and the wheels take 3 MiB less, without which the two calls do not fit.

usage: python3 scripts/vllm_pack.py [--wheel-dir /tmp/vllmwhl] [--limit-mib 60]
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import io
import lzma
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEV = REPO / ".vllmdev"
VERSION = "0.33.0"
SO = "vllm/_C_stable_libtorch.abi3.so"
SO_XZ = "_C_stable_libtorch.abi3.so.xz"  # the name device_vllm.sh joins the parts into
# vLLM's FlashAttention 3 build (Hopper), for the engine runs (scripts/vllm_engine.py): 165 MiB,
# about 11 MiB as xz, in a call of its own (PHASE=fa). FA2 (294 MiB) stays behind: on sm 9.0
# vLLM picks FA3.
FA3 = "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so"
MOE_SO = "vllm/_moe_C_stable_libtorch.abi3.so"
# docs/VLLM.md ("CUDA and the driver"): the index's sha256 of the x86-64 wheel, as it is quoted.
WHEEL_SHA_HEAD, WHEEL_SHA_TAIL = "4b6bdec4", "83aa"
MIB = 1 << 20

# What `import vllm` and tests/vllm/vllm_worker.py import (constraints-vllm.txt, traced in the
# CPU suite's worker) that the device image does not have: its package list (the workplace's
# description of the 'cuda' image, 2026-11-17) has transformers 5.17.0 (vLLM asks
# >=5.16.1,<5.21), tokenizers, huggingface_hub, numpy, safetensors, aiohttp, pillow, ... but not
# these. Also missing there, and left behind: blake3 (vLLM hashes multimodal inputs with it) and
# jiter (openai's streamed chat parser); the worker imported neither on the CPU.
DEVICE_LACKS = (
    "annotated-types",
    "apache-tvm-ffi",
    "cachetools",
    "cbor2",
    "compressed-tensors",
    "fastapi",
    "httpcore2",
    "httpx2",
    "llguidance",
    "loguru",
    "msgspec",
    "openai",
    "oss-harmony",
    "partial-json-parser",
    "pybase64",
    "pydantic",
    "pydantic_core",
    "pyzmq",
    "sniffio",
    "starlette",
    "truststore",
    "typing-inspection",
    "xgrammar",
)
#: What vLLM's multimodal wrapper classes import beyond DEVICE_LACKS (Llava and Mistral 3:
#: mistral_common and its deps; torchvision and tiktoken are in the device's image), for the
#: engine runs of the wrappers. In ``.vllmdev/mm``, carried by the call PHASE=fa (call 1 and
#: call 2 have no room), which installs them into vLLM's environment.
DEVICE_MM = (
    "jsonschema",
    "jsonschema-specifications",
    "mistral_common",
    "pycountry",
    "pydantic-extra-types",
    "referencing",
    "rpds-py",
)
#: What `vllm serve` (the OpenAI server) imports beyond DEVICE_LACKS, and the loaders it is
#: compared with (scripts/vllm_serve.py): ``.vllmdev/serve``, carried by RUN=serve's call.
#: model-hosting-container-standards (and its jmespath and supervisor) is imported only when the
#: server builds its app, after the engine is up: the H200 run of 2026-12-05 failed there.
DEVICE_SERVE = (
    "fastsafetensors",
    "jmespath",
    "model-hosting-container-standards",
    "orjson",
    "prometheus-fastapi-instrumentator",
    "runai-model-streamer",
    "supervisor",
    "uvicorn",
    "watchfiles",
)
# llguidance 1.7.6 is built for manylinux_2_31 only. The device's glibc is not listed; its Python
# 3.12.3 is Ubuntu 24.04's (glibc 2.39), and the earlier run loaded vLLM's manylinux_2_28 ops.
PLATFORMS = (
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux_2_28_x86_64",
    "manylinux_2_31_x86_64",
)

# Left out of vllm-py.tar.xz (see the docstring).
SKIP_SUFFIXES = (".so", ".h", ".hpp", ".cuh", ".inl", ".cu", ".cpp", ".c")
SKIP_NAMES = ("vllm/vllm-rs",)


def fail(msg: str, code: int = 1) -> None:
    print(f"vllm_pack: {msg}", file=sys.stderr)
    sys.exit(code)


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def get_wheel(wheel_dir: Path) -> Path:
    """vLLM's wheel in ``wheel_dir``, downloaded there if it is not; checked for CPython 3.12
    on x86-64 Linux and against the sha256 docs/VLLM.md quotes."""
    found = sorted(wheel_dir.glob(f"vllm-{VERSION}-*.whl"))
    if not found:
        wheel_dir.mkdir(parents=True, exist_ok=True)
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            f"vllm=={VERSION}",
            "--no-deps",
            "--only-binary=:all:",
            "-d",
            str(wheel_dir),
        ]
        print("+", " ".join(cmd))
        subprocess.run(cmd, check=True)
        found = sorted(wheel_dir.glob(f"vllm-{VERSION}-*.whl"))
    wheels = [w for w in found if w.name.endswith("x86_64.whl")]
    if len(wheels) != 1:
        fail(
            f"want one x86-64 vllm {VERSION} wheel in {wheel_dir}, found {[w.name for w in found]}"
        )
    whl = wheels[0]
    # name-version-python-abi-platform: cp38-abi3 loads on any CPython >= 3.8 (3.12 there).
    _, _, py, abi, plat = whl.name[: -len(".whl")].split("-")
    if not (py.startswith("cp3") and int(py[3:]) <= 12 and abi == "abi3"):
        fail(f"{whl.name}: not a wheel CPython 3.12 loads (python {py}, abi {abi})")
    if not any(p.startswith("manylinux") and p.endswith("_x86_64") for p in plat.split(".")):
        fail(f"{whl.name}: not a manylinux x86-64 wheel ({plat})")
    digest = hashlib.sha256(whl.read_bytes()).hexdigest()
    if not (digest.startswith(WHEEL_SHA_HEAD) and digest.endswith(WHEEL_SHA_TAIL)):
        fail(f"{whl}: sha256 {digest} is not the index's {WHEEL_SHA_HEAD}...{WHEEL_SHA_TAIL}")
    print(f"wheel  {whl} (sha256 {digest[:8]}...{digest[-4:]})")
    return whl


def read_checked(z: zipfile.ZipFile, record: dict[str, str], name: str) -> bytes:
    data = z.read(name)
    if record.get(name) != record_hash(data):
        fail(f"{name}: not the bytes the wheel's RECORD lists")
    return data


def pack_python(z: zipfile.ZipFile, record: dict[str, str], out: Path) -> int:
    """vllm-py.tar.xz: the wheel's files but the ones left out; returns how many."""
    buf = io.BytesIO()
    n = 0
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info in sorted(z.infolist(), key=lambda i: i.filename):
            name = info.filename
            if info.is_dir() or name.endswith(SKIP_SUFFIXES) or name in SKIP_NAMES:
                continue
            data = z.read(name) if name.endswith("/RECORD") else read_checked(z, record, name)
            ti = tarfile.TarInfo(name)
            ti.size, ti.mode = len(data), 0o644
            ti.mtime = int(time.mktime(info.date_time + (0, 0, -1)))
            tar.addfile(ti, io.BytesIO(data))
            n += 1
    out.write_bytes(lzma.compress(buf.getvalue(), preset=9 | lzma.PRESET_EXTREME))
    return n


def pack_so(data: bytes) -> bytes:
    """The .so as xz: the x86 branch filter first (it makes the host code compress better; the
    CUDA code inside is data to it), then LZMA2 at its highest setting. ``xz -d`` undoes both."""
    filters = [
        {"id": lzma.FILTER_X86},
        {"id": lzma.FILTER_LZMA2, "preset": 9 | lzma.PRESET_EXTREME},
    ]
    return lzma.compress(data, format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC64, filters=filters)


def wheel_record(z: zipfile.ZipFile) -> dict[str, str]:
    """The wheel's RECORD: file name -> ``sha256=...``."""
    rows = csv.reader(io.StringIO(z.read(f"vllm-{VERSION}.dist-info/RECORD").decode()))
    return {row[0]: row[1] for row in rows if len(row) == 3 and row[1]}  # names may hold commas


def pack_ext(z: zipfile.ZipFile, record: dict[str, str], so: str, folder: str, note: str) -> None:
    """.vllmdev/<folder>: one compiled extension ``so`` of the wheel as xz and its sha256
    (``<folder>.sha256``), for the device_vllm.sh call of that name."""
    out = DEV / folder
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    print(f"compressing {so} (x86 filter + xz -9e)")
    data = pack_so(read_checked(z, record, so))
    name = Path(so).name + ".xz"
    (out / name).write_bytes(data)
    (out / f"{folder}.sha256").write_text(f"{hashlib.sha256(data).hexdigest()}  {name}\n")
    print(f"  {len(data) / MIB:6.2f} MiB  .vllmdev/{folder} ({note})")


def pack_fa(z: zipfile.ZipFile, record: dict[str, str]) -> None:
    """.vllmdev/fa: FA3, for the call PHASE=fa of device_vllm.sh."""
    pack_ext(z, record, FA3, "fa", "the call PHASE=fa carries .vllmdev/mw and .vllmdev/mm too")


def pack_moe(z: zipfile.ZipFile, record: dict[str, str]) -> None:
    """.vllmdev/moe: vLLM's MoE ops (``topk_softmax``, the Marlin MoE GEMM), for the call
    PHASE=moe of device_vllm.sh, which the MoE engines (RUN=tokens) need."""
    pack_ext(z, record, MOE_SO, "moe", "the call PHASE=moe, for the MoE engines")


def pins() -> dict[str, str]:
    """constraints-vllm.txt, name -> version."""
    out = {}
    for line in (REPO / "constraints-vllm.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            out[norm(name)] = version.strip()
    return out


def get_wheels(dest: Path, wanted: tuple[str, ...] = DEVICE_LACKS) -> None:
    """The wheels of ``wanted`` for CPython 3.12 on x86-64 Linux, each stored again with LZMA."""
    pinned = pins()
    missing = [n for n in wanted if norm(n) not in pinned]
    if missing:
        fail(f"constraints-vllm.txt pins no version of {missing}")
    reqs = [f"{n}=={pinned[norm(n)]}" for n in wanted]
    raw = dest.parent / "w-download"
    shutil.rmtree(raw, ignore_errors=True)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "-q",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        "3.12",
        "--implementation",
        "cp",
        *[a for p in PLATFORMS for a in ("--platform", p)],
        "-d",
        str(raw),
        *reqs,
    ]
    print("+", " ".join(cmd[:6]), "...", len(reqs), "wheels")
    subprocess.run(cmd, check=True)
    got = sorted(raw.glob("*.whl"))
    names = sorted(norm(w.name.split("-")[0]) for w in got)
    if names != sorted(norm(n) for n in wanted):
        fail(f"pip downloaded {[w.name for w in got]}, not one wheel each of {wanted}")
    dest.mkdir(parents=True)
    for w in got:
        relzma(w, dest / w.name)
    shutil.rmtree(raw)


def relzma(src_path: Path, dst_path: Path) -> None:
    """The same wheel, its files stored with LZMA instead of deflate."""
    with zipfile.ZipFile(src_path) as src, zipfile.ZipFile(dst_path, "w", zipfile.ZIP_LZMA) as dst:
        for info in src.infolist():
            dst.writestr(info, src.read(info), compress_type=zipfile.ZIP_LZMA)


def split_msite(device_wheels: Path) -> None:
    """mpack's environment (.device/wheels) without the wheels call 1 already carries: those it
    shares with vLLM's (pydantic and its deps, loguru) are named in w/msite.txt, and call 1
    installs them into it from w/; the others (compressed-tensors, cuda-bindings, ...) go in mw/,
    for the call PHASE=fa."""
    shared = []
    for w in sorted(device_wheels.glob("*.whl")):
        if (DEV / "w" / w.name).exists():
            shared.append(w.name)
        else:
            (DEV / "mw").mkdir(exist_ok=True)
            relzma(w, DEV / "mw" / w.name)
    (DEV / "w" / "msite.txt").write_text("".join(n + "\n" for n in shared))


def tree_bytes() -> int:
    """What every call carries besides its pieces: the tracked files and the untracked ones git
    does not ignore (as the device tool counts the working tree)."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        check=True,
        capture_output=True,
    ).stdout
    total = 0
    for name in set(out.split(b"\0")) - {b""}:
        p = REPO / os.fsdecode(name)
        if p.is_symlink() or p.is_file():
            total += p.lstat().st_size
    return total


def size_of(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def cut_pieces(data: bytes, room: int, dest: Path, name: str) -> int:
    """``data`` in pieces of at most ``room`` bytes, ``dest/NAME-NN/piece`` beside
    ``data.sha256`` (the digest of the whole, ``name`` and the piece count); how many pieces."""
    n = -(-len(data) // room)
    for old in dest.glob(f"{name}-*"):
        shutil.rmtree(old)
    digest = hashlib.sha256(data).hexdigest()
    for i in range(n):
        d = dest / f"{name}-{i:02d}"
        d.mkdir(parents=True)
        (d / "piece").write_bytes(data[i * room : (i + 1) * room])
        (d / "data.sha256").write_text(f"{digest} {name} {n}\n")
    return n


def pack_data(archive: Path, limit: int) -> int:
    """``archive`` in pieces, ``.vllmdev/data/NAME-NN/piece`` (one call each, carry
    ``.vllmdev/data/NAME-NN``; NAME: the archive's name up to its first dot), each beside
    ``data.sha256``, the whole archive's digest and its piece count: PHASE=data joins them on
    the device once all have come, checks the digest and unpacks the archive (a tar, compressed
    or not: tar tells) into /tmp/real."""
    room = limit - tree_bytes() - (64 << 10)  # the digest file and some slack
    if room <= 0:
        fail(f"the tree alone fills a call's {limit / MIB:g} MiB", 3)
    data = archive.read_bytes()
    name = archive.name.split(".")[0]
    n = cut_pieces(data, room, DEV / "data", name)
    print(f"{archive}: {len(data) / MIB:.2f} MiB in {n} pieces of at most {room / MIB:.2f} MiB")
    print(
        "calls: PHASE=data, carry one each: "
        + " ".join(f".vllmdev/data/{name}-{i:02d}" for i in range(n))
    )
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--wheel-dir", type=Path, default=Path("/tmp/vllmwhl"))
    ap.add_argument("--limit-mib", type=float, default=60.0)
    ap.add_argument("--fa-only", action="store_true", help="only .vllmdev/fa (FA3, PHASE=fa)")
    ap.add_argument(
        "--moe-only", action="store_true", help="only .vllmdev/moe (the MoE ops, PHASE=moe)"
    )
    ap.add_argument(
        "--serve-only", action="store_true", help="only .vllmdev/serve (RUN=serve's wheels)"
    )
    ap.add_argument(
        "--data",
        type=Path,
        help="only .vllmdev/data: FILE (an archive of checkpoints) cut into one piece per call "
        "(PHASE=data), each as large as the tree leaves room for",
    )
    args = ap.parse_args()
    limit = int(args.limit_mib * MIB)
    if args.data:
        return pack_data(args.data, limit)
    if args.serve_only:
        shutil.rmtree(DEV / "serve", ignore_errors=True)
        get_wheels(DEV / "serve", DEVICE_SERVE)
        print(f"  {size_of(DEV / 'serve') / MIB:6.2f} MiB  .vllmdev/serve")
        return 0
    if args.fa_only or args.moe_only:
        with zipfile.ZipFile(get_wheel(args.wheel_dir)) as z:
            (pack_fa if args.fa_only else pack_moe)(z, wheel_record(z))
        return 0

    device_wheels = REPO / ".device" / "wheels"
    if not any(device_wheels.glob("*.whl")):
        fail(f"{device_wheels} holds no wheels: mpack's environment on the device comes from it", 3)
    whl = get_wheel(args.wheel_dir)

    for d in ("p1", "p2", "w", "w-download", "mw", "mm"):
        shutil.rmtree(DEV / d, ignore_errors=True)
    for f in ("vllm-py.tar.xz", "so.sha256"):
        (DEV / f).unlink(missing_ok=True)
    for d in ("p1", "p2"):
        (DEV / d).mkdir(parents=True)
    with zipfile.ZipFile(whl) as z:
        record = wheel_record(z)
        pack_fa(z, record)
        pack_moe(z, record)
        print("packing vLLM's Python files (xz -9e, about a minute)")
        n = pack_python(z, record, DEV / "vllm-py.tar.xz")
        print(f"  {n} files")
        print(f"compressing {SO} (x86 filter + xz -9e, about two minutes)")
        so_xz = pack_so(read_checked(z, record, SO))
    get_wheels(DEV / "w")
    get_wheels(DEV / "mm", DEVICE_MM)
    split_msite(device_wheels)

    digest = hashlib.sha256(so_xz).hexdigest()
    (DEV / "so.sha256").write_text(f"{digest}  {SO_XZ}\n")
    tree = tree_bytes()
    call1 = [DEV / "vllm-py.tar.xz", DEV / "w", DEV / "so.sha256"]
    call2 = [DEV / "p2"]  # empty until part01 is written
    rest1 = tree + sum(size_of(p) for p in call1)
    rest2 = tree + sum(size_of(p) for p in call2)
    # Cut where both calls come out the same size: the most room for the tree to grow.
    cut = min(max((rest2 + len(so_xz) - rest1) // 2, 1), len(so_xz) - 1)
    (DEV / "p1" / "part00").write_bytes(so_xz[:cut])
    (DEV / "p2" / "part01").write_bytes(so_xz[cut:])

    def mib(n: int) -> str:
        return f"{n / MIB:6.2f} MiB"

    print(f"\ntree (tracked + untracked, not ignored)  {mib(tree)}")
    rows = [
        ("call 1 (PHASE=1)", call1 + [DEV / "p1"]),
        ("call fa (PHASE=fa)", [DEV / "fa", DEV / "mw", DEV / "mm"]),
        ("call 2 (PHASE=2)", call2),
        ("call moe (PHASE=moe)", [DEV / "moe"]),
    ]
    worst = 0
    for title, paths in rows:
        total = tree + sum(size_of(p) for p in paths)
        worst = max(worst, total)
        print(f"{title}: {mib(total)}  carry: {' '.join(str(p.relative_to(REPO)) for p in paths)}")
        for p in paths:
            print(f"    {mib(size_of(p))}  {p.relative_to(REPO)}")
    print(f"{SO_XZ}: {mib(len(so_xz))}, sha256 {digest}")
    if worst > limit:
        fail(
            f"a call would carry {mib(worst).strip()}, over the {args.limit_mib:g} MiB this "
            "script allows (the device tool's limit is 64 MiB, tree included): shrink the tree "
            "or the pieces",
            3,
        )
    print(f"both calls under {args.limit_mib:g} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
