"""The compressed-tensors FP8 input: config, shards, quantized layers, and their validation.

Reading is in two steps. :func:`open_checkpoint` parses ``config.json`` (the quantization
config with compressed-tensors' own pydantic models), the shard index and every safetensors
header — no tensor data. :func:`find_layers` then checks every quantized layer's scheme and
shapes, and :func:`check_scale_values` its scale values, before any heavy work, reading only the
small scale tensors. Problems raise an
``InputError`` naming the file, layer and value, with what to do.

A quantized linear ``X`` is ``X.weight`` of dtype F8_E4M3 plus ``X.weight_scale`` (SPEC §1);
the config's targets are used to cross-check, not to find layers.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from mpack.convert import autofp8
from mpack.errors import (
    CorruptFileError,
    SourceNotFoundError,
    UnsupportedSchemeError,
    arg,
    quote,
    shown,
)
from mpack.fsutil import parse_json
from mpack.iokit import PREAD_PIECE, pread_full, pread_pieces
from mpack.sidecar import (
    CONFIG_NAME,
    INDEX_NAME,
    SINGLE_NAME,
    TensorEntry,
    read_file_map,
    torch_dtype,
)
from mpack.target import ACT_DTYPES, BIAS, BLOCK_FP8, BLOCK_FP8_HINT, QUANT_METHODS, SCALE, WEIGHT

if TYPE_CHECKING:  # torch is imported where a tensor is made: planning needs none
    import torch

INPUT_SCALE = "input_scale"
#: Parts of a quantized linear that the sidecar consumes (never passed through).
LINEAR_PARTS = (WEIGHT, SCALE, INPUT_SCALE, BIAS, "weight_zero_point", "input_zero_point")


@dataclass(frozen=True)
class SourceTensor:
    """A tensor in a checkpoint shard: ``file`` relative to the checkpoint root."""

    name: str
    file: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int


@dataclass
class QuantLayer:
    """One quantized linear of the checkpoint (module name without ``.weight``)."""

    module: str
    n: int
    k: int
    strategy: str  # "tensor" | "channel"
    has_bias: bool


@dataclass
class Checkpoint:
    """A compressed-tensors checkpoint directory, headers parsed, no tensor data read."""

    root: Path
    config: dict[str, Any]
    #: compressed_tensors.quantization.QuantizationConfig, or autofp8.Fp8Config (quant_method
    #: fp8); None where the scheme is checked apart (open_checkpoint's ``scheme=False``)
    qconfig: Any
    files: list[str]  # safetensors shards, relative names
    tensors: dict[str, SourceTensor]
    layers: dict[str, QuantLayer] = field(default_factory=dict)

    @property
    def architecture(self) -> str | None:
        archs = self.config.get("architectures") or self.text_config.get("architectures") or []
        return archs[0] if archs else None

    @property
    def quant_method(self) -> str:
        """config.json's ``quant_method`` (a key of :data:`mpack.target.QUANT_METHODS`)."""
        return find_quant_config(self.config)["quant_method"]

    @property
    def text_config(self) -> dict[str, Any]:
        return self.config.get("text_config") or self.config

    @property
    def dtype(self) -> str | None:
        """The model dtype from config.json (``dtype`` or the older ``torch_dtype``)."""
        tc = self.text_config
        return (
            tc.get("dtype")
            or tc.get("torch_dtype")
            or self.config.get("dtype")
            or self.config.get("torch_dtype")
        )

    def read(self, name: str) -> torch.Tensor:
        """Read one tensor from disk into a new CPU tensor, in its stored dtype (fp8 as
        ``torch.float8_e4m3fn``)."""
        import torch

        t = self.tensors[name]
        out = torch.from_numpy(self.read_bytes(name))
        return out.view(torch_dtype(t.dtype)).reshape(t.shape)

    def read_bytes(self, name: str, out: np.ndarray | None = None) -> np.ndarray:
        """Read one tensor's bytes from disk into ``out`` (a uint8 array of its size) or a new
        array; no torch needed."""
        if out is None:
            out = np.empty(self.tensors[name].nbytes, dtype=np.uint8)  # every byte is read below
        self.read_into(name, memoryview(out))
        return out

    def read_into(self, name: str, out: memoryview, skip: int = 0) -> None:
        """Read the next ``len(out)`` bytes of tensor ``name``, from its byte ``skip`` on, into
        ``out`` (any writable buffer, e.g. pinned host memory)."""
        self.read_pieces(name, [(out, skip)])

    def read_pieces(self, name: str, pieces: list[tuple[memoryview, int]]) -> None:
        """Fill each ``(buffer, skip)`` with tensor ``name``'s bytes from ``skip`` on.

        Large reads run as several preads at once (:func:`mpack.iokit.pread_pieces`). Raises
        ``CorruptFileError`` if the file is truncated.
        """
        self.read_parts([(name, out, skip) for out, skip in pieces])

    def read_parts(self, parts: list[tuple[str, Any, int]]) -> None:
        """Fill each ``(tensor name, buffer, skip)`` with that tensor's bytes from ``skip`` on:
        many tensors with one open per shard (a MoE batch's experts, every scale of a model).

        Where a shard's part is ``PREAD_PIECE`` bytes or more, its preads run at once
        (:func:`mpack.iokit.pread_pieces`); smaller parts, one after another here (a pool hand-off
        costs more than a pread of a few KB). Raises ``CorruptFileError`` if a file is
        truncated.
        """
        by_file: dict[str, list[tuple[str, memoryview, int]]] = {}
        for name, out, skip in parts:
            t = self.tensors[name]
            view = memoryview(out).cast("B")
            if skip + len(view) > t.nbytes:
                raise ValueError(f"{name}: {len(view)} bytes from {skip} pass the end ({t.nbytes})")
            if len(view):
                by_file.setdefault(t.file, []).append((name, view, t.offset + skip))
        for file, named in by_file.items():
            path = self.root / file
            at = [(view, offset) for _, view, offset in named]
            with open(path, "rb", buffering=0) as f:
                if sum(len(v) for v, _ in at) >= PREAD_PIECE:
                    short = pread_pieces(f.fileno(), at)
                else:
                    short = _pread_each(f.fileno(), at)
            if short is not None:
                name = next(n for n, v, o in named if o <= short < o + len(v))
                raise CorruptFileError(f"{path}: tensor {name!r} is truncated at byte {short}")


def _pread_each(fd: int, at: list[tuple[memoryview, int]]) -> int | None:
    """Each ``(buffer, file offset)`` of ``at`` by one pread after another on this thread: None,
    or the file offset at which the file ended first (as :func:`mpack.iokit.pread_pieces`)."""
    for view, offset in at:
        got = pread_full(fd, view, offset)
        if got < len(view):
            return offset + got
    return None


# --- quantization config ------------------------------------------------------------------


def find_quant_config(config: dict[str, Any]) -> dict[str, Any] | None:
    """``quantization_config``, else ``text_config.quantization_config``, else
    ``compression_config``.

    The old ``compression_config`` wrapped the quantization config one level down.
    """
    qc = config.get("quantization_config")
    if qc is None and isinstance(config.get("text_config"), dict):
        qc = config["text_config"].get("quantization_config")
    if qc is None and isinstance(config.get("compression_config"), dict):
        cc = config["compression_config"]
        qc = cc.get("quantization_config", cc)
    return qc


def check_quant_scheme(qc: dict[str, Any], where: Path) -> None:
    """Refuse, from the raw config alone, a checkpoint that is not compressed-tensors or AutoFP8
    (``quant_method: fp8``) FP8.

    Another ``quant_method`` (GPTQ, AWQ, ...) or a config group whose weights are not 8-bit
    floats (W4A16, W8A8, NVFP4, ...) is named as such here, before any tensor is looked at: its
    tensors (``weight_packed``, int8 weights) would otherwise be reported one layer at a time.
    Needs neither torch nor compressed-tensors, so the CLI's first pass makes the same check as
    the full one (Note [scheme check in a child] in :mod:`mpack.convert.scheme_check`).

    Raises:
        UnsupportedSchemeError: naming ``where`` (config.json) and the scheme, with a hint.
    """
    method = qc.get("quant_method")
    if not isinstance(method, str) or method not in QUANT_METHODS:
        raise UnsupportedSchemeError(
            f"{where}: quant_method is {quote(method)}, mpack reads "
            f"{' and '.join(QUANT_METHODS)} FP8 checkpoints",
            hint="convert the model with llm-compressor (compressed-tensors FP8) first",
        )
    if method == autofp8.QUANT_METHOD:
        autofp8.parse(qc, where)
        return
    groups = qc.get("config_groups")
    if not isinstance(groups, dict):
        return  # compressed-tensors' own parse reports it
    for gname, g in groups.items():
        w = g.get("weights") if isinstance(g, dict) else None
        if not isinstance(w, dict):
            continue
        bits, kind = w.get("num_bits"), w.get("type")
        if (type(bits) is int and bits != 8) or (isinstance(kind, str) and kind != "float"):
            acts = g.get("input_activations")
            label = scheme_label(w, acts if isinstance(acts, dict) else None)
            which = f" (config group {str(gname)[:80]!r})" if len(groups) > 1 else ""
            raise UnsupportedSchemeError(
                f"{where}: quantization scheme {label}{which} is not FP8; mpack converts "
                "compressed-tensors FP8 (float8_e4m3fn) checkpoints",
                hint="use the model's FP8 checkpoint (llm-compressor preset FP8 or FP8_DYNAMIC, "
                "e.g. RedHatAI/<model>-FP8), or quantize the original with one of those; vLLM "
                "runs this checkpoint with its own kernels, without mpack",
            )


def scheme_label(weights: dict[str, Any], acts: dict[str, Any] | None) -> str:
    """A config group's scheme as llm-compressor's presets name it, with the facts behind the
    name: ``W4A16 (int4 weights, group size 128)``, ``W8A8 (int8 weights, per channel; int8
    activations)``, ``NVFP4 (fp4 weights, group size 16; fp4 activations)``."""

    def short(v: Any) -> str:
        return str(v)[:40]

    bits, kind = weights.get("num_bits"), weights.get("type")
    strategy, group = weights.get("strategy"), weights.get("group_size")
    abits = acts.get("num_bits") if acts else None
    if kind == "float" and strategy == "tensor_group" and bits == 4:
        name = "NVFP4" + ("" if acts else "A16")
    elif kind == "float" and strategy == "group" and group == 32:
        name = f"MXFP{short(bits)}" + ("" if acts else "A16")
    else:
        name = f"W{short(bits)}A{short(abits) if acts else 16}"
    prefix = {"int": "int", "float": "fp"}.get(str(kind), f"{short(kind)} ")
    facts = [f"{prefix}{short(bits)} weights"]
    if strategy in ("group", "tensor_group"):
        facts.append(f"group size {short(group)}")
    elif strategy == "block":
        facts.append(f"blocks {short(weights.get('block_structure'))}")
    elif strategy is not None:
        facts.append(f"per {short(strategy)}")
    if weights.get("symmetric") is False:
        facts.append("asymmetric")
    text = ", ".join(facts)
    if acts:
        aprefix = {"int": "int", "float": "fp"}.get(str(acts.get("type")), "")
        text += f"; {aprefix}{short(abits)} activations"
    return f"{name} ({text})"


def _strip_unknown(obj: Any, model: Any) -> Any:
    """Drop keys a pydantic model does not declare (older/newer serialisations add some)."""
    if not isinstance(obj, dict):
        return obj
    return {k: v for k, v in obj.items() if k in model.model_fields}


def parse_quant_config(qc: dict[str, Any], where: Path) -> Any:
    """Parse with compressed-tensors' own ``QuantizationConfig`` (0.19 and 0.20 serialisations).

    0.20 writes only the fields it uses; 0.19 also wrote defaults (``observer``,
    ``observer_kwargs``, ``scale_dtype``, ...). Fields the installed models do not know are dropped
    and parsing is retried, so either serialisation parses. The caller runs
    :func:`check_quant_scheme` first (:func:`open_checkpoint`). An AutoFP8 config is read by
    :func:`mpack.convert.autofp8.parse` instead.
    """
    if qc.get("quant_method") == autofp8.QUANT_METHOD:
        return autofp8.parse(qc, where)
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
    )
    from pydantic import ValidationError

    try:
        return QuantizationConfig.model_validate(qc)
    except ValidationError:
        pass
    groups = {}
    for gname, g in (qc.get("config_groups") or {}).items():
        if isinstance(g, dict):
            g = _strip_unknown(g, QuantizationScheme)
            for part in ("weights", "input_activations", "output_activations"):
                if isinstance(g.get(part), dict):
                    g[part] = _strip_unknown(g[part], QuantizationArgs)
        groups[gname] = g
    try:
        return QuantizationConfig.model_validate({**qc, "config_groups": groups})
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(x) for x in first["loc"])
        raise UnsupportedSchemeError(
            f"{where}: quantization_config.{shown(loc)}: {first['msg']} "
            f"(got {quote(first.get('input'))})"
        ) from None


def _scheme_for(module: str, qconfig: Any) -> Any | None:
    """The config group whose targets match ``module`` (class targets like 'Linear' match all)."""
    from compressed_tensors.utils.match import match_name

    for scheme in qconfig.config_groups.values():
        for target in scheme.targets:
            is_class = not target.startswith("re:") and "." not in target and target[:1].isupper()
            if is_class or match_name(module, target):
                return scheme
    return None


def _ignored(module: str, qconfig: Any) -> bool:
    from compressed_tensors.utils.match import match_name

    return any(match_name(module, t) for t in (qconfig.ignore or []))


# --- opening ------------------------------------------------------------------------------


def open_checkpoint(root: str | os.PathLike, *, scheme: bool = True) -> Checkpoint:
    """Parse config, quantization config, index and every shard header of ``root``.

    Args:
        scheme: parse the quantization config with compressed-tensors (``ck.qconfig``). False
            leaves ``ck.qconfig`` None: the caller checks the scheme separately, with
            :class:`SchemeCheck` (Note [scheme check in a child]).

    Raises:
        SourceNotFoundError, CorruptFileError, UnsupportedSchemeError: with the file at fault.
    """
    root = Path(root)
    config, qconfig = _read_config(root, scheme)
    files, weight_map = _shard_files(root)
    tensors = _shard_tensors(root, files, weight_map)
    return Checkpoint(root=root, config=config, qconfig=qconfig, files=files, tensors=tensors)


def _read_config(root: Path, scheme: bool) -> tuple[dict[str, Any], Any]:
    """``config.json`` and, with ``scheme``, its quantization config parsed by
    compressed-tensors."""
    cfg_path = root / CONFIG_NAME
    if not cfg_path.is_file():
        raise SourceNotFoundError(f"{root}: no {CONFIG_NAME}: not a Hugging Face model directory")
    config = parse_json(cfg_path.read_bytes(), cfg_path)
    if not isinstance(config, dict):
        raise CorruptFileError(f"{cfg_path}: holds a JSON {type(config).__name__}, not an object")
    qc = find_quant_config(config)
    if not isinstance(qc, dict):
        raise UnsupportedSchemeError(
            f"{cfg_path}: no quantization_config: the checkpoint is not quantized",
            hint="mpack converts compressed-tensors FP8 checkpoints (e.g. RedHatAI/*-FP8)",
        )
    check_quant_scheme(qc, cfg_path)
    # An AutoFP8 config needs no compressed-tensors: it is always read here.
    full = scheme or qc.get("quant_method") == autofp8.QUANT_METHOD
    return config, parse_quant_config(qc, cfg_path) if full else None


def _shard_files(root: Path) -> tuple[list[str], dict[str, str] | None]:
    """The safetensors files (from the index, else the single file, else every one) and the
    index's weight map, if there is an index."""
    index_path = root / INDEX_NAME
    weight_map: dict[str, str] | None = None
    if index_path.is_file():
        index = parse_json(index_path.read_bytes(), index_path, "index")
        try:
            weight_map = index["weight_map"]
            if not isinstance(weight_map, dict):
                raise ValueError("weight_map is not an object")
        except (ValueError, KeyError, TypeError) as e:
            raise CorruptFileError(f"{index_path}: malformed index ({e})") from None
        files = sorted(set(weight_map.values()))
    elif (root / SINGLE_NAME).is_file():
        files = [SINGLE_NAME]
    else:
        files = sorted(p.name for p in root.glob("*.safetensors"))
    if not files:
        raise SourceNotFoundError(f"{root}: no safetensors files (and no {INDEX_NAME})")
    return files, weight_map


def _shard_tensors(
    root: Path, files: list[str], weight_map: dict[str, str] | None
) -> dict[str, SourceTensor]:
    """Every tensor of every shard, from the headers; each name once, where the index says."""
    index_path = root / INDEX_NAME
    tensors: dict[str, SourceTensor] = {}
    for fname in files:
        path = root / fname
        if not path.is_file():
            raise SourceNotFoundError(
                f"{index_path}: lists shard {fname}, which does not exist in {root}"
            )
        for e in read_file_map(path).entries:
            if e.name in tensors:
                raise CorruptFileError(
                    f"{path}: tensor {e.name!r} also appears in {tensors[e.name].file}"
                )
            tensors[e.name] = _source_tensor(e, fname)
    for name, fname in (weight_map or {}).items():
        if name not in tensors or tensors[name].file != fname:
            found = tensors[name].file if name in tensors else "no shard"
            raise CorruptFileError(f"{index_path}: maps {name!r} to {fname}, but it is in {found}")
    return tensors


def _source_tensor(e: TensorEntry, fname: str) -> SourceTensor:
    return SourceTensor(e.name, fname, e.dtype, tuple(e.shape), e.offset, e.nbytes)


# --- validation ---------------------------------------------------------------------------


def _where(ck: Checkpoint, name: str) -> str:
    return f"{ck.root / ck.tensors[name].file}: {name}"


def find_layers(ck: Checkpoint) -> dict[str, QuantLayer]:
    """Every quantized linear, validated: scheme, dtype, scale shape. Fills ``ck.layers``."""
    layers: dict[str, QuantLayer] = {}
    for name, t in ck.tensors.items():
        if not name.endswith("." + SCALE):
            continue
        module = name[: -len(SCALE) - 1]
        wname = f"{module}.{WEIGHT}"
        if wname not in ck.tensors:
            raise UnsupportedSchemeError(
                f"{_where(ck, name)}: has a weight_scale but no {wname} (packed int weights?)",
                hint="mpack supports FP8 (float8_e4m3fn) weights only",
            )
        w = ck.tensors[wname]
        if w.dtype != "F8_E4M3":
            raise UnsupportedSchemeError(
                f"{_where(ck, wname)}: weight dtype {w.dtype}, expected F8_E4M3 "
                "(int or non-8-bit weights)",
                hint="mpack converts FP8 checkpoints (presets FP8 / FP8_DYNAMIC)",
            )
        layers[module] = _check_layer(ck, module, w, t)
    for name, t in ck.tensors.items():
        if (
            name.endswith("." + WEIGHT)
            and t.dtype == "F8_E4M3"
            and name[: -len(WEIGHT) - 1] not in layers
        ):
            raise UnsupportedSchemeError(
                f"{_where(ck, name)}: FP8 weight without a weight_scale",
                hint="the checkpoint is incomplete; re-export it with llm-compressor",
            )
    if not layers:
        if ck.quant_method == autofp8.QUANT_METHOD:
            raise autofp8.not_serialized(ck.root)
        raise UnsupportedSchemeError(
            f"{ck.root}: no FP8 quantized layers (no F8_E4M3 weight with a weight_scale)"
        )
    ck.layers = layers
    return layers


def _check_layer(ck: Checkpoint, module: str, w: SourceTensor, s: SourceTensor) -> QuantLayer:
    where = _where(ck, w.name)
    if len(w.shape) != 2:
        raise UnsupportedSchemeError(f"{where}: weight shape {list(w.shape)} is not 2-D")
    n, k = w.shape
    if isinstance(ck.qconfig, autofp8.Fp8Config):
        strategy = autofp8.check_layer(ck, ck.qconfig, module, s, where)
    elif ck.qconfig is None:  # structural check only: the strategy follows from the scale's shape
        strategy = "tensor" if math.prod(s.shape) == 1 else "channel"
    else:
        strategy = _check_scheme(ck, module, where)
    numel = math.prod(s.shape)
    want = 1 if strategy == "tensor" else n
    if numel != want or (strategy == "channel" and s.shape not in ((n, 1), (n,))):
        raise UnsupportedSchemeError(
            f"{_where(ck, s.name)}: scale shape {list(s.shape)} does not fit strategy {strategy!r} "
            f"of a [{n}, {k}] weight (expected {want} value{'s' if want > 1 else ''})"
        )
    if s.dtype not in ("BF16", "F16", "F32"):
        raise UnsupportedSchemeError(
            f"{_where(ck, s.name)}: scale dtype {s.dtype}, expected BF16, F16 or F32"
        )
    if k % 4:
        raise UnsupportedSchemeError(
            f"{where}: K={k} is not a multiple of 4, which Marlin requires"
        )
    bname = f"{module}.{BIAS}"
    if bname in ck.tensors and ck.tensors[bname].shape != (n,):
        raise UnsupportedSchemeError(
            f"{_where(ck, bname)}: bias shape {list(ck.tensors[bname].shape)}, expected [{n}]"
        )
    return QuantLayer(module=module, n=n, k=k, strategy=strategy, has_bias=bname in ck.tensors)


def _check_scheme(ck: Checkpoint, module: str, where: str) -> str:
    """The weight strategy the quantization config gives ``module``, checked for Marlin FP8."""
    scheme = _scheme_for(module, ck.qconfig)
    if scheme is None or scheme.weights is None:
        raise UnsupportedSchemeError(
            f"{where}: FP8 weight, but no quantization_config group targets {module}"
        )
    if _ignored(module, ck.qconfig):
        raise UnsupportedSchemeError(
            f"{where}: FP8 weight, but quantization_config.ignore lists {module}"
        )
    args = scheme.weights
    strategy = str(getattr(args.strategy, "value", args.strategy))
    if str(getattr(args.type, "value", args.type)) != "float" or args.num_bits != 8:
        raise UnsupportedSchemeError(
            f"{where}: weight scheme {args.type} {args.num_bits}-bit; "
            "mpack packs 8-bit float (FP8) only"
        )
    if strategy == "block":
        raise UnsupportedSchemeError(
            f"{where}: weight strategy 'block': block FP8; {BLOCK_FP8}",
            hint=BLOCK_FP8_HINT,
        )
    if strategy not in ("tensor", "channel"):
        raise UnsupportedSchemeError(
            f"{where}: weight strategy {strategy!r}: mpack packs tensor- and channel-scaled FP8 "
            "only",
            hint="use a checkpoint quantized per tensor (preset FP8) or per channel (FP8_DYNAMIC)",
        )
    return strategy


def read_scale(ck: Checkpoint, module: str) -> torch.Tensor:
    """A layer's scales as a float32 tensor ``[1]`` (tensor) or ``[N]`` (channel); exact cast."""
    import torch

    return torch.from_numpy(read_scale_array(ck, module))


def read_scale_array(ck: Checkpoint, module: str) -> np.ndarray:
    """:func:`read_scale` as a numpy float32 array, without torch."""
    return read_scale_arrays(ck, [module])[module]


def read_scale_arrays(ck: Checkpoint, modules: list[str]) -> dict[str, np.ndarray]:
    """:func:`read_scale_array` of each of ``modules``, read with one open per shard."""
    names = [f"{m}.{SCALE}" for m in modules]
    raw = {n: np.empty(ck.tensors[n].nbytes, dtype=np.uint8) for n in names}
    ck.read_parts([(n, memoryview(a), 0) for n, a in raw.items()])
    return {
        m: float32_values(raw[n], ck.tensors[n].dtype) for m, n in zip(modules, names, strict=True)
    }


def float32_values(raw: np.ndarray, dtype: str) -> np.ndarray:
    """The float32 values of raw little-endian ``F32``, ``F16`` or ``BF16`` bytes: exact."""
    if dtype == "F32":
        return raw.view("<f4").astype(np.float32)
    if dtype == "F16":
        return raw.view("<f2").astype(np.float32)
    if dtype == "BF16":
        return (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
    raise ValueError(f"not a float dtype of 32 bits or fewer: {dtype}")


def check_scale_values(ck: Checkpoint, module: str, scale: Any, act_dtype: str) -> None:
    """Reject NaN/inf/<=0 scales and scales that overflow when folded (SPEC §1, §7).
    ``scale``: float32 values, a numpy array or a CPU tensor."""
    name = f"{module}.{SCALE}"
    scale = np.asarray(scale, dtype=np.float32).reshape(-1)
    bad = ~np.isfinite(scale) | (scale <= 0)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise UnsupportedSchemeError(
            f"{_where(ck, name)}: scale[{i}] = {float(scale[i])!r} (must be finite and > 0)",
            hint="the checkpoint's scales are broken; re-quantize it",
        )
    limit = ACT_DTYPES[act_dtype].fold_limit  # SPEC §1: larger scales fold to inf
    big = scale > limit
    if big.any():
        i = int(np.flatnonzero(big)[0])
        raise UnsupportedSchemeError(
            f"{_where(ck, name)}: scale[{i}] = {float(scale[i])!r} exceeds {limit} "
            f"and would become inf after Marlin's exponent fold in {act_dtype}",
            hint=(
                f"use {arg('act_dtype', 'float16')} (limit {ACT_DTYPES['float16'].fold_limit}) "
                "or a checkpoint with smaller scales"
                if act_dtype == "bfloat16"
                else "this checkpoint's scales are too large for Marlin; "
                "re-quantize it with smaller scales"
            ),
        )


def passthrough_names(ck: Checkpoint) -> list[str]:
    """Checkpoint tensors that are not part of a quantized linear, in name order."""
    consumed = {f"{m}.{p}" for m in ck.layers for p in LINEAR_PARTS}
    return sorted(n for n in ck.tensors if n not in consumed)


def layer_summary(layers: dict[str, QuantLayer]) -> dict[str, tuple[str, int, int, bool]]:
    return {m: (q.strategy, q.n, q.k, q.has_bias) for m, q in layers.items()}
