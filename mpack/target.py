"""The target: what vLLM 0.33.0's FP8 Marlin kernel takes, as plain facts (SPEC §1, §3.3, §7).

This module is the one owner of every fact about the target that more than one part of mpack
uses: the engine and kernel a sidecar is made for, the profiles and fusions, the activation
dtypes (storage code, exponent fold, largest foldable scale), the padding rule
the names, dtypes and shapes of the packed tensors of one layer, and the scales' 32-channel
permutation (shared by the torch layout code and the torch-free host path). ``convert`` writes by
them, ``mpack.sidecar`` checks rank files against them, the runtime and the vLLM loader compare with
them. How the bytes are arranged inside those tensors belongs to :mod:`mpack.convert.marlin`.

It imports neither torch nor anything else of mpack but :mod:`mpack.errors` (a leaf itself, for
:func:`check_layout`'s refusal), so every layer can use it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mpack.errors import UsageError, arg

ENGINE = "vllm"
ENGINE_VERSION = "0.33.0"
KERNEL = "marlin-fp8"
#: ``w8a16``: FP8 weights, 16-bit activations; ``w8a8-marlin``: an FP8 W8A8 checkpoint run by
#: Marlin (tensor-strategy shards requantized to one scale, SPEC §6).
PROFILES = ("w8a16", "w8a8-marlin")
#: The checkpoint formats mpack reads (config.json's ``quant_method``) -> the profiles vLLM
#: 0.33.0 runs them with on Marlin, each with the vLLM class whose layers a sidecar stands in for.
#: An AutoFP8 checkpoint (``fp8``) is weight-only on Marlin whatever its activation scheme
#: (mpack/convert/autofp8.py).
QUANT_METHODS: dict[str, dict[str, str]] = {
    "compressed-tensors": {
        "w8a16": "CompressedTensorsW8A16Fp8",
        "w8a8-marlin": "CompressedTensorsW8A8Fp8",
    },
    "fp8": {"w8a16": "Fp8LinearMethod"},
}
#: The refusal of a block-quantized FP8 checkpoint, whichever format holds it: mpack's limit,
#: not vLLM's (vLLM 0.33.0 runs block FP8 itself, CompressedTensorsW8A16Fp8 on Marlin included).
BLOCK_FP8 = (
    "mpack packs tensor- and channel-scaled FP8 only; vLLM loads a block FP8 checkpoint itself "
    "(without mpack)"
)
BLOCK_FP8_HINT = "serve this checkpoint with vLLM directly, without --load-format mpack"
#: A target's experts split whole across its TP ranks, as vLLM 0.33.0 places them with
#: ``--enable-expert-parallel`` (and data parallelism 1): rank ``r`` of ``T`` holds experts
#: ``[r*E/T, (r+1)*E/T)`` at their full intermediate size (``expert_placement_strategy``
#: ``linear``); the attention and a shared expert stay TP-sharded. A manifest's target has
#: ``"expert_parallel": true`` then, and no such key otherwise.
EXPERT_PARALLEL = "expert_parallel"
#: ``vllm``: vLLM's fused ``qkv_proj`` / ``gate_up_proj`` names; ``none``: checkpoint names.
FUSIONS = ("vllm", "none")
#: ``mpack convert --layout`` (Note [target layout] in mpack/target_dirs.py): ``auto`` (one
#: target at ``OUT`` itself unless ``OUT`` already holds targets; several under
#: ``OUT/<target>/``) or ``targets`` (always ``OUT/<target>/``).
LAYOUTS = ("auto", "targets")


def check_layout(layout: str) -> None:
    """Refuse a layout that is not one of :data:`LAYOUTS` (a :class:`UsageError`)."""
    if layout not in LAYOUTS:
        raise UsageError(
            f"{arg('layout')} must be one of {', '.join(LAYOUTS)}, got {layout!r}",
            hint=f"{arg('layout', 'targets')} writes OUT/<target>/ whatever the target count",
        )


#: Input channels per row of the packed weight (the tile is 64 output x 16 input, SPEC §5).
TILE_K = 16
#: Checkpoint tensor suffixes of a quantized linear that the packed layer replaces.
WEIGHT, SCALE, BIAS = "weight", "weight_scale", "bias"


@dataclass(frozen=True)
class ActDtype:
    """One activation dtype of the kernel. Scales and bias are stored in it."""

    name: str  # "bfloat16" | "float16": the name torch, transformers and vLLM use
    st: str  # its safetensors dtype code
    exp_fold: float  # SPEC §7.5: the exponent-bias fold multiplied into the scales
    fold_limit: float  # SPEC §1: the largest scale that stays finite after the fold


#: Position ``m`` of every 32-channel group of scales and bias takes channel ``SCALE_PERM[m]``
#: (SPEC §7.4).
SCALE_PERM: tuple[int, ...] = (
    0,
    1,
    8,
    9,
    16,
    17,
    24,
    25,
    2,
    3,
    10,
    11,
    18,
    19,
    26,
    27,
    4,
    5,
    12,
    13,
    20,
    21,
    28,
    29,
    6,
    7,
    14,
    15,
    22,
    23,
    30,
    31,
)


ACT_DTYPES: dict[str, ActDtype] = {
    "bfloat16": ActDtype("bfloat16", "BF16", 2.0**120, 255.0),
    "float16": ActDtype("float16", "F16", 2.0**8, 255.875),
}


def act_dtype(name: str) -> ActDtype:
    """The :class:`ActDtype` called ``name``; ``ValueError`` naming the choices otherwise."""
    try:
        return ACT_DTYPES[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"activation dtype must be one of {', '.join(ACT_DTYPES)}, got {name!r}"
        ) from None


def dir_name(target: Mapping[str, Any]) -> str:
    """The folder name of a sidecar's target (a manifest's ``target``): ``tp{N}-{profile}-
    {act_dtype}``, e.g. ``tp2-w8a16-bfloat16`` (``tp2ep-...``: a MoE model's experts split
    whole across the ranks, :data:`EXPERT_PARALLEL`); ``-fuse-none`` is appended for a sidecar with
    checkpoint names (``--fuse none``), so that no two targets share a name. The multi-target
    ``mpack convert`` writes ``OUT/<name>/``, and ``mpack push`` uploads to that repo folder."""
    ep = "ep" if target.get("expert_parallel") else ""
    name = f"tp{target['tp_size']}{ep}-{target['profile']}-{target['act_dtype']}"
    fusion = target.get("fusion", "vllm")
    return name if fusion == "vllm" else f"{name}-fuse-{fusion}"


def target_of_name(name: str) -> dict[str, Any] | None:
    """The target keys :func:`dir_name` writes into a folder name, read back (``tp_size``,
    ``profile``, ``act_dtype``, ``fusion`` and, for ``tp{N}ep-``, :data:`EXPERT_PARALLEL`); None
    for a name :func:`dir_name` never makes. For folders whose manifest cannot be read yet (a
    Hub repo's tree, an HF-cache snapshot's links): a manifest, where there is one, says more."""
    head, _, rest = name.partition("-")
    if not head.startswith("tp"):
        return None
    tp, ep = (head[2:-2], True) if head.endswith("ep") else (head[2:], False)
    if not tp.isdigit() or tp.startswith("0"):
        return None
    for profile in PROFILES:
        for act in ACT_DTYPES:
            for fusion in FUSIONS:
                t: dict[str, Any] = {
                    "tp_size": int(tp),
                    "profile": profile,
                    "act_dtype": act,
                    "fusion": fusion,
                }
                if ep:
                    t[EXPERT_PARALLEL] = True
                if dir_name(t) == name:
                    return t
    return None


def _roundup(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def padded_nk(n: int, k: int) -> tuple[int, int]:
    """The padded ``(Np, Kp)`` of a layer with ``n`` output and ``k`` input channels (SPEC §3.3).

    Candidates ``(roundup(n, 64), roundup(k, 128))`` and ``(roundup(n, 128), roundup(k, 64))``;
    the smaller ``Np*Kp`` wins, then the smaller ``Np+Kp``, then the first.
    """
    if n <= 0 or k <= 0:
        raise ValueError(f"layer dims must be positive, got N={n}, K={k}")
    a = (_roundup(n, 64), _roundup(k, 128))
    b = (_roundup(n, 128), _roundup(k, 64))
    return min((a, b), key=lambda c: (c[0] * c[1], c[0] + c[1]))  # min() keeps the first on ties


def packed_weight_shape(np_: int, kp: int) -> tuple[int, int]:
    """int32 ``[Kp/16, 4*Np]``: one row per 16 input channels, 4 words per output channel."""
    return (kp // TILE_K, 4 * np_)


def packed_specs(
    name: str, np_: int, kp: int, act: str, bias: bool, experts: int | None = None
) -> list[tuple[str, str, tuple[int, ...]]]:
    """``(tensor name, safetensors dtype, shape)`` of one packed layer's tensors, in file order:
    the weight, the scales ``[1, Np]``, and the bias ``[Np]`` when the layer has one. A MoE
    block's experts (``experts``: their count) are stacked as vLLM's ``FusedMoE`` holds them:
    ``<name>_weight`` ``[E, Kp/16, 4*Np]`` and ``<name>_weight_scale`` ``[E, 1, Np]``, no bias."""
    st = act_dtype(act).st
    if experts is not None:
        return [
            (f"{name}_{WEIGHT}", "I32", (experts, *packed_weight_shape(np_, kp))),
            (f"{name}_{SCALE}", st, (experts, 1, np_)),
        ]
    specs = [
        (f"{name}.{WEIGHT}", "I32", packed_weight_shape(np_, kp)),
        (f"{name}.{SCALE}", st, (1, np_)),
    ]
    if bias:
        specs.append((f"{name}.{BIAS}", st, (np_,)))
    return specs
