"""``--load-format mpack``: vLLM takes its FP8 Marlin weights from an mpack sidecar.

Installed with the ``vllm`` extra, mpack registers :func:`register` under vLLM's
``vllm.general_plugins`` entry point group; vLLM calls it in every process (API server, engine
core, workers) and it registers the load format ``mpack``. This is the only module of mpack that
imports vLLM (docs/VLLM.md).

What :class:`MpackModelLoader` does, in order (Note [loading from a sidecar]):

1. **Checks, before any model memory is allocated**: the sidecar's manifest (the same strict
   checks as every mpack reader), then its target against the engine: vLLM's version, the TP
   size, the activation dtype against the model dtype, the fusion, and the profile against the
   compressed-tensors scheme vLLM will choose on this GPU (``w8a16``: CompressedTensorsW8A16Fp8;
   ``w8a8-marlin``: CompressedTensorsW8A8Fp8, sm >= 8.9); the checkpoint's quantization scheme
   must be FP8 with tensor or channel weight scales, and the model's dimensions those the
   sidecar was made from. A ``--linear-backend`` other than Marlin is refused; left at ``auto``,
   the FP8 linear layers of this model are put on Marlin (the sidecar holds Marlin weights).
2. **The rank's tensors**: attached zero-copy from ``mpack serve`` (``attach: auto|require``) or
   loaded privately with :func:`mpack.runtime.load` (``never``, or ``auto`` with no daemon).
3. **The model, built as vLLM builds it** (``create_model``), on the target device.
4. **Every Marlin layer** gets the sidecar's ``weight``, ``weight_scale`` and ``bias`` as its
   parameters' data (the attached views themselves: no copy), loses ``input_scale`` as Marlin's
   own processing would, and is left out of ``process_weights_after_loading``.
5. **Everything else goes through vLLM's own code**: embeddings, norms and lm_head are fed from
   ``common.safetensors`` to ``model.load_weights`` (vLLM shards them for its TP rank), and every
   other module gets vLLM's ordinary post-load processing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mpack import arch
from mpack.errors import DaemonError, InputError, MpackError, UnsupportedSchemeError, UsageError
from mpack.sidecar import (
    COMMON_NAME,
    MANIFEST_NAME,
    MODEL_DIMS,
    expected_rank_tensors,
    load_manifest,
)

log = logging.getLogger("mpack.vllm")

LOAD_FORMAT = "mpack"
ATTACH_MODES = ("auto", "require", "never")
#: The keys ``--model-loader-extra-config`` may hold for ``--load-format mpack``.
EXTRA_KEYS = ("sidecar", "attach", "socket")
#: The compressed-tensors scheme class vLLM runs each profile's layers with.
PROFILE_SCHEMES = {"w8a16": "CompressedTensorsW8A16Fp8", "w8a8-marlin": "CompressedTensorsW8A8Fp8"}
#: vLLM's quantization keys of the two FP8 paths that run through Marlin.
MARLIN_QUANT_KEYS = ("w8a16_fp8", "fp8_w8a8")


class EngineMismatchError(UnsupportedSchemeError):
    """The sidecar was made for another engine, TP size, profile, dtype or model."""


def register() -> None:
    """The ``vllm.general_plugins`` entry point: register the ``mpack`` load format. Cheap,
    idempotent, touches no device."""
    from vllm.model_executor.model_loader import _LOAD_FORMAT_TO_MODEL_LOADER, register_model_loader

    cls = loader_class()
    if _LOAD_FORMAT_TO_MODEL_LOADER.get(LOAD_FORMAT) is not cls:  # vLLM warns on a re-register
        register_model_loader(LOAD_FORMAT)(cls)


def __getattr__(name: str) -> Any:
    # The loader class derives from vLLM's DefaultModelLoader, so it is defined on first use:
    # importing this module (e.g. to read its constants) does not import vLLM.
    if name == "MpackModelLoader":
        return loader_class()
    raise AttributeError(name)


@dataclasses.dataclass(frozen=True)
class Options:
    """``--model-loader-extra-config`` for ``--load-format mpack``."""

    sidecar: str | None = None
    attach: str = "auto"
    socket: str | None = None

    @classmethod
    def parse(cls, extra: Any) -> Options:
        extra = dict(extra or {})
        unknown = sorted(set(extra) - set(EXTRA_KEYS))
        if unknown:
            raise UsageError(
                f"--model-loader-extra-config: unknown key(s) {', '.join(unknown)} for "
                f"--load-format mpack",
                hint=f"the keys are {', '.join(EXTRA_KEYS)} (docs/VLLM.md)",
            )
        opts = cls(**extra)
        if opts.attach not in ATTACH_MODES:
            raise UsageError(
                f"--model-loader-extra-config: attach is {opts.attach!r}, not one of "
                f"{', '.join(ATTACH_MODES)}"
            )
        return opts


def sidecar_dir(opts: Options, model: str) -> Path:
    """The sidecar: ``{"sidecar": PATH}``, else the model directory itself."""
    if opts.sidecar:
        return Path(opts.sidecar)
    if (Path(model) / MANIFEST_NAME).is_file():
        return Path(model)
    raise InputError(
        f"{model}: not an mpack sidecar (no {MANIFEST_NAME}) and no sidecar named",
        hint="serve the sidecar directory as the model, or pass "
        '--model-loader-extra-config \'{"sidecar": "PATH"}\'',
    )


# --- checks against the engine (before any model memory) ----------------------------------------


def expected_profile(quant_config: dict[str, Any], capability: int | None) -> str:
    """The mpack profile of the scheme vLLM 0.33.0 picks for an FP8 compressed-tensors config:
    W8A8 (activations quantized too) on sm >= 8.9 -> ``w8a8-marlin``; weight-only, or any FP8 on
    an older GPU -> ``w8a16``.

    Raises:
        EngineMismatchError: a scheme vLLM does not run through its FP8 Marlin path (block or
            group FP8, integer weights, ...).
    """
    groups = quant_config.get("config_groups") or {}
    acts = set()
    for name, group in groups.items():
        w = (group or {}).get("weights") or {}
        strategy, kind, bits = w.get("strategy"), w.get("type"), w.get("num_bits")
        if not (kind == "float" and bits == 8 and strategy in ("tensor", "channel")):
            raise EngineMismatchError(
                f"quantization group {name!r}: weights {kind} {bits}-bit, strategy {strategy}: "
                "vLLM runs only FP8 weights with tensor or channel scales through its FP8 Marlin "
                "path, which is what an mpack sidecar holds",
                hint="convert and serve this model without mpack",
            )
        acts.add(bool(group.get("input_activations")))
    if not groups:
        raise EngineMismatchError("the model's quantization config has no config_groups")
    w8a8 = any(acts)
    return "w8a8-marlin" if (w8a8 and capability is not None and capability >= 89) else "w8a16"


def check_target(manifest: dict[str, Any], engine: dict[str, Any], where: Path) -> None:
    """Every fact of the sidecar's target that the engine fixes, compared; one error naming both
    values for the first that differs (docs/VLLM.md, "What is refused")."""
    t = manifest["target"]
    checks = [
        ("engine version", t["engine_version"], engine["version"],
         f"convert it for this vLLM: mpack convert SOURCE -o {where} --force (mpack targets "
         f"vLLM {t['engine_version']})"),
        ("tensor-parallel size", t["tp_size"], engine["tp_size"],
         f"run vLLM with --tensor-parallel-size {t['tp_size']}, or convert with "
         f"--tp {engine['tp_size']}"),
        ("activation dtype", t["act_dtype"], engine["dtype"],
         f"run vLLM with --dtype {t['act_dtype']}, or convert with --act-dtype {engine['dtype']}"),
        ("fusion", t["fusion"], "vllm", "convert with --fuse vllm (vLLM's fused layer names)"),
        ("profile", t["profile"], engine["profile"],
         f"convert with --profile {engine['profile']}: {engine['profile_why']}"),
    ]  # fmt: skip
    for what, have, want, hint in checks:
        if have != want:
            raise EngineMismatchError(
                f"{where}: the sidecar's {what} is {have}, the engine's is {want}", hint=hint
            )
    made_from = (manifest.get("model") or {}).get("architecture")
    if made_from not in arch.LLAMA_FAMILY or made_from != engine["architecture"]:
        raise EngineMismatchError(
            f"{where}: the sidecar was made from a {made_from} model, this model is a "
            f"{engine['architecture']}; mpack's fusion rules cover {', '.join(arch.LLAMA_FAMILY)}",
            hint="serve the sidecar of this model (mpack inspect shows what a sidecar holds)",
        )
    cfg = (manifest.get("model") or {}).get("config") or {}
    for key in MODEL_DIMS:
        if key in cfg and key in engine["model"] and cfg[key] != engine["model"][key]:
            raise EngineMismatchError(
                f"{where}: the sidecar was made from a model with {key} {cfg[key]}, this model "
                f"has {engine['model'][key]}",
                hint="serve the sidecar of this model (mpack inspect shows what a sidecar holds)",
            )


def _engine_facts(vllm_config: Any, model_config: Any) -> dict[str, Any]:
    import vllm
    from vllm.distributed import get_tensor_model_parallel_world_size
    from vllm.platforms import current_platform

    cap = current_platform.get_device_capability()
    capability = cap.to_int() if cap is not None else None
    qc = getattr(model_config.hf_config, "quantization_config", None)
    if not isinstance(qc, dict) or qc.get("quant_method") != "compressed-tensors":
        raise EngineMismatchError(
            f"{model_config.model}: the model is not a compressed-tensors checkpoint "
            f"(quantization {getattr(model_config, 'quantization', None)})"
        )
    profile = expected_profile(qc, capability)
    why = f"vLLM runs this checkpoint with {PROFILE_SCHEMES[profile]} on sm {capability}"
    text = model_config.hf_config.get_text_config()
    return {
        "version": vllm.__version__,
        "tp_size": get_tensor_model_parallel_world_size(),
        "dtype": str(model_config.dtype).removeprefix("torch."),
        "profile": profile,
        "profile_why": why,
        "model": {k: getattr(text, k) for k in MODEL_DIMS if hasattr(text, k)},
        "architecture": (getattr(model_config.hf_config, "architectures", None) or [None])[0],
    }


def force_marlin(vllm_config: Any) -> None:
    """Put the FP8 linear layers of this model on Marlin; refuse another explicit choice."""
    kc = vllm_config.kernel_config
    per = dict(kc.linear_backend_per_quant or {})
    for key in MARLIN_QUANT_KEYS:
        chosen = per.get(key) or kc.linear_backend
        if chosen not in ("auto", "marlin", None):
            raise UsageError(
                f"--linear-backend / linear_backend_per_quant[{key!r}] is {chosen!r}, but "
                "--load-format mpack holds Marlin weights",
                hint="drop the option, or pass --linear-backend marlin",
            )
        per[key] = "marlin"
    kc.linear_backend_per_quant = per


# --- the rank's tensors ---------------------------------------------------------------------------


def rank_weights(sidecar: Path, opts: Options, rank: int, device: str) -> Any:
    """The rank's ``SharedWeights``: attached (zero-copy) or loaded privately, per ``attach``."""
    from mpack.runtime import attach, load

    if opts.attach != "never":
        try:
            w = attach(sidecar, rank=rank, device=device, socket=opts.socket)
            log.info("mpack: rank %d attached zero-copy (%d bytes on %s)", rank, w.nbytes, device)
            return w
        except DaemonError as e:
            if opts.attach == "require":
                raise DaemonError(
                    f"attach: require, but {e.message}",
                    hint=f"start it: mpack serve {sidecar} --rank {rank} --device {device}",
                ) from None
            log.warning("mpack: rank %d loads privately: %s", rank, e.message)
    w = load(sidecar, rank=rank, device=device)
    log.info("mpack: rank %d loaded privately (%d bytes on %s)", rank, w.nbytes, device)
    return w


def _device_label(target: torch.device) -> str:
    if target.type == "cuda":
        return f"cuda:{target.index if target.index is not None else torch.cuda.current_device()}"
    return "cpu"


# --- the loader ----------------------------------------------------------------------------------


def checked_sidecar(
    opts: Options, vllm_config: Any, model_config: Any
) -> tuple[Path, dict[str, Any]]:
    """The sidecar to load and its manifest, once everything the engine fixes agrees with it
    (before any model memory); the model's FP8 linears are then put on Marlin."""
    pp = vllm_config.parallel_config.pipeline_parallel_size
    if pp != 1:
        raise UsageError(
            f"--load-format mpack does not support pipeline parallelism "
            f"(--pipeline-parallel-size {pp})",
            hint="use tensor parallelism (mpack convert --tp N)",
        )
    sidecar = sidecar_dir(opts, model_config.model)
    manifest, _ = load_manifest(sidecar)
    check_target(manifest, _engine_facts(vllm_config, model_config), sidecar)
    force_marlin(vllm_config)
    return sidecar, manifest


@functools.cache
def loader_class() -> type:
    """vLLM's ``DefaultModelLoader`` subclass for ``--load-format mpack`` (built once)."""
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.utils.torch_utils import set_default_torch_dtype

    class MpackModelLoader(DefaultModelLoader):
        """``--load-format mpack`` (Note [loading from a sidecar] in the module docstring)."""

        def __init__(self, load_config: Any) -> None:
            self.options = Options.parse(load_config.model_loader_extra_config)
            # DefaultModelLoader reads the rest of the model (common.safetensors, or the
            # checkpoint's non-Marlin tensors): hand it a load config it knows.
            super().__init__(
                dataclasses.replace(
                    load_config, load_format="safetensors", model_loader_extra_config={}
                )
            )

        def download_model(self, model_config: Any) -> None:
            pass  # the sidecar is local; a Hub model argument is resolved by vLLM itself

        def load_weights(self, model: nn.Module, model_config: Any) -> None:
            weights = getattr(model, "_mpack_weights", None)
            if weights is None:
                raise MpackError("--load-format mpack loads weights only through load_model")
            self._load_rest(model, model_config, weights)

        def load_model(self, vllm_config: Any, model_config: Any, prefix: str = "") -> nn.Module:
            from vllm.distributed import get_tensor_model_parallel_rank

            sidecar, manifest = checked_sidecar(self.options, vllm_config, model_config)
            load_device = vllm_config.load_config.device or vllm_config.device_config.device
            target = torch.device(load_device)
            rank = get_tensor_model_parallel_rank()
            weights = rank_weights(sidecar, self.options, rank, _device_label(target))
            try:
                with set_default_torch_dtype(model_config.dtype):
                    with target:
                        model = self.create_model(vllm_config, model_config, prefix)
                    model._mpack_weights = weights  # the lease and mappings live with the model
                    layers = _swap_in(model, manifest, weights, sidecar)
                    self._load_rest(model, model_config, weights)
                    _process_others(
                        model, layers, model_config, target, process_weights_after_loading
                    )
            except BaseException:
                weights.close()
                raise
            return model.eval()

        def _load_rest(self, model: nn.Module, model_config: Any, weights: Any) -> None:
            """Every non-Marlin tensor, through vLLM's own weight loaders."""
            model.load_weights(_rest_of_model(self, model, model_config, weights))

    return MpackModelLoader


def _scheme_kernel(layer: nn.Module) -> tuple[Any, Any]:
    scheme = getattr(layer, "scheme", None)
    kernel = getattr(scheme, "linear_kernel", None) or getattr(scheme, "fp8_linear", None)
    return scheme, kernel


def _swap_in(
    model: nn.Module, manifest: dict[str, Any], weights: Any, sidecar: Path
) -> dict[str, nn.Module]:
    """Give every Marlin layer the sidecar's tensors; return the layers by name.

    Note [loading from a sidecar]: each parameter keeps its vLLM ``Parameter`` object (and with
    it its weight loader), and its ``.data`` becomes the sidecar's tensor itself: with an
    attached sidecar a view of the daemon's read-only mapping, never a copy. ``input_scale`` is
    removed and ``processed_weight_dims`` set, as Marlin's own processing leaves them; for a
    per-tensor W8A16 layer the scheme's weight key becomes per-channel, as vLLM's does.
    """
    from vllm.model_executor.kernels.linear.scaled_mm.marlin import MarlinFP8ScaledMMLinearKernel

    modules = dict(model.named_modules())
    want = PROFILE_SCHEMES[manifest["target"]["profile"]]
    missing = [n for n in manifest["layers"] if n not in modules]
    if missing:
        raise EngineMismatchError(
            f"{sidecar}: the model has no layer {missing[0]}"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
            + ": the sidecar was made for another model",
            hint="serve the sidecar of this model (mpack inspect shows its layers)",
        )
    for name, ly in manifest["layers"].items():
        layer = modules[name]
        scheme, kernel = _scheme_kernel(layer)
        if type(scheme).__name__ != want or not isinstance(kernel, MarlinFP8ScaledMMLinearKernel):
            raise EngineMismatchError(
                f"{sidecar}: layer {name} runs {type(scheme).__name__} with "
                f"{type(kernel).__name__}; the sidecar holds {want} weights for Marlin",
                hint="pass --linear-backend marlin, or convert for this engine",
            )
        dims = (layer.output_size_per_partition, layer.input_size_per_partition)
        if dims != (ly["n"], ly["k"]):
            raise EngineMismatchError(
                f"{sidecar}: layer {name} is {dims[0]} x {dims[1]} in the model, "
                f"{ly['n']} x {ly['k']} in the sidecar"
            )
        for leaf in ("weight", "weight_scale", "bias"):
            key = f"{name}.{leaf}"
            if key in weights:
                param = getattr(layer, leaf, None)
                if isinstance(param, nn.Parameter):
                    param.data = weights[key]
                else:
                    layer.register_parameter(leaf, nn.Parameter(weights[key], requires_grad=False))
        layer._parameters.pop("input_scale", None)
        with contextlib.suppress(AttributeError):
            delattr(layer, "input_scale")
        layer.processed_weight_dims = (0, 1)
        _as_processed(scheme, ly)
    return {name: modules[name] for name in manifest["layers"]}


def _as_processed(scheme: Any, ly: dict[str, Any]) -> None:
    """What vLLM's W8A16 processing changes on the scheme itself: a per-tensor layer's scales
    become per-channel (schemes/compressed_tensors_w8a16_fp8.py)."""
    if type(scheme).__name__ != PROFILE_SCHEMES["w8a16"] or ly.get("strategy") != "tensor":
        return
    from compressed_tensors.quantization import QuantizationStrategy
    from vllm.model_executor.layers.quantization.compressed_tensors.utils import (
        STRATEGY_TO_WEIGHT_QUANT_KEY,
    )

    scheme.weight_quant_key = STRATEGY_TO_WEIGHT_QUANT_KEY[QuantizationStrategy.CHANNEL]
    scheme.linear_kernel.config.weight_quant_key = scheme.weight_quant_key


def _rest_of_model(
    loader: Any, model: nn.Module, model_config: Any, weights: Any
) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors vLLM loads itself: ``common.safetensors`` from the sidecar's allocation, or,
    for a sidecar written with ``--no-passthrough``, the checkpoint's tensors other than the
    Marlin layers' (the manifest's ``shards`` name their checkpoint modules)."""
    manifest = weights.manifest
    in_rank_file = expected_rank_tensors(manifest)
    common = [n for n in weights if n not in in_rank_file]
    if common:
        for name in common:
            yield name, weights[name]
        return
    if (Path(model_config.model) / MANIFEST_NAME).is_file():
        raise InputError(
            f"{model_config.model}: the sidecar has no {COMMON_NAME} (written with "
            "--no-passthrough), so vLLM has no embeddings, norms or lm_head to load",
            hint="pass the original checkpoint as the model and "
            '--model-loader-extra-config \'{"sidecar": "PATH"}\'',
        )
    skip = {s["module"] for ly in manifest["layers"].values() for s in ly.get("shards", [])}
    for name, tensor in loader.get_all_weights(model_config, model):
        if name.rpartition(".")[0] not in skip:
            yield name, tensor


def _process_others(
    model: nn.Module,
    layers: dict[str, nn.Module],
    model_config: Any,
    target: torch.device,
    process: Any,
) -> None:
    """vLLM's ``process_weights_after_loading`` for every module but the Marlin layers, whose
    weights are already in Marlin's format (re-running Marlin's repack on them would be wrong)."""
    held = {layer: layer.quant_method for layer in layers.values()}
    for layer in held:
        layer.quant_method = None  # the loop skips modules without a quant method
    try:
        process(model, model_config, target)
    finally:
        for layer, qm in held.items():
            layer.quant_method = qm
            layer.update_param_tp_status()
    with contextlib.suppress(RuntimeError):
        torch.accelerator.empty_cache()


__all__ = ["LOAD_FORMAT", "Options", "check_target", "expected_profile", "loader_class", "register"]
