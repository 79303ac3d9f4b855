"""``MpackModelLoader``: vLLM's model loader for ``--load-format mpack``.

:func:`mpack.runtime.vllm.register` registers it with vLLM. The class derives from vLLM's
``DefaultModelLoader``, so this module imports vLLM: import it only where vLLM is importable.
The checks it runs on its inputs are runtime/vllm/checks.py; where it reads from (the sidecar,
the rank's tensors), runtime/vllm/source.py.

What :class:`MpackModelLoader` does, in order (Note [loading from a sidecar]):

1. **Checks, before any model memory is allocated** (Note [the loader trusts nothing in the
   sidecar] in runtime/vllm/checks.py): ``--model-loader-extra-config``; the sidecar's manifest
   (the same strict checks as every mpack reader), then its target against the engine: vLLM's
   version, the TP size, the activation dtype against the model dtype, the fusion, and the
   profile against the compressed-tensors scheme vLLM will choose on this GPU (``w8a16``:
   CompressedTensorsW8A16Fp8; ``w8a8-marlin``: CompressedTensorsW8A8Fp8, sm >= 8.9); the
   checkpoint's quantization scheme must be FP8 with tensor or channel weight scales, the
   model's dimensions those the sidecar was made from, the sidecar's layers exactly the linears
   vLLM will run on FP8 Marlin, and ``common.safetensors`` (or a ``--no-passthrough`` sidecar's
   ``shards``) fit for this model. A ``--linear-backend`` other than Marlin is refused; left at
   ``auto``, the FP8 linear layers of this model are put on Marlin (the sidecar holds Marlin
   weights).
2. **The rank's tensors**: attached zero-copy from ``mpack serve`` (``attach: auto|require``) or
   loaded privately with :func:`mpack.runtime.load` (``never``, or ``auto`` with no daemon):
   :func:`~mpack.runtime.vllm.source.rank_weights`. At pipeline-parallel size > 1, those of the
   rank's stage: from the daemon of that stage (``serve --pp-rank``, refused when its split is
   not the engine's) or of the whole rank, or loaded privately for the stage alone.
3. **The model, built as vLLM builds it** (``create_model``), on the target device.
4. **Every Marlin layer** of the rank's pipeline stage (all of them at PP 1; the decoder layers
   vLLM's ``get_pp_indices`` gives the stage: :func:`pp_stage`, Note [a layer range per stage]
   in docs/FORMAT.md) gets the sidecar's ``weight``, ``weight_scale`` and ``bias`` as its
   parameters' data (the attached views themselves: no copy), loses ``input_scale`` as Marlin's
   own processing would, and is left out of ``process_weights_after_loading``. Every layer vLLM
   built with a quantization scheme must be one of them, and each must have exactly those
   parameters.
5. **Everything else goes through vLLM's own code**: embeddings, norms and lm_head are fed from
   ``common.safetensors`` to ``model.load_weights`` (vLLM shards them for its TP rank), and every
   other module gets vLLM's ordinary post-load processing. Every parameter of the model must
   then have been loaded: vLLM checks that itself only for unquantized models.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
from vllm.model_executor.model_loader.utils import process_weights_after_loading
from vllm.utils.torch_utils import set_default_torch_dtype

from mpack import arch
from mpack.binding import check_bound
from mpack.errors import (
    CorruptFileError,
    InputError,
    MpackError,
    UsageError,
    shown,
)
from mpack.runtime.vllm import logger, moe
from mpack.runtime.vllm.checks import (
    OTHER_MODEL_HINT,
    EngineMismatchError,
    Options,
    check_common,
    check_layers,
    check_shards,
    check_target,
    decoder_linears,
    expected_profile,
    first_and_more,
    layout,
    quant_method_of,
    scheme_class,
)
from mpack.runtime.vllm.inplace import InPlace
from mpack.runtime.vllm.placeholders import Placeholders, building
from mpack.runtime.vllm.source import rank_weights, sidecar_dir
from mpack.sidecar import (
    COMMON_NAME,
    MODEL_DIMS,
    expected_rank_tensors,
    load_manifest,
    read_file_map,
)
from mpack.target import EXPERT_PARALLEL

#: vLLM's quantization keys of the two FP8 paths that run through Marlin.
MARLIN_QUANT_KEYS = ("w8a16_fp8", "fp8_w8a8")


def engine_target(engine: dict[str, Any]) -> dict[str, Any]:
    """The target the engine runs (a manifest's ``target`` keys, for its folder name)."""
    return {
        "tp_size": engine["tp_size"],
        "profile": engine["profile"],
        "act_dtype": engine["dtype"],
        "fusion": "vllm",
        **({EXPERT_PARALLEL: True} if engine["expert_parallel"] else {}),
    }


def _expert_parallel(vllm_config: Any, model_config: Any) -> bool:
    """Whether the engine splits a MoE model's experts whole across its ranks (vLLM 0.33.0's
    ``use_ep``: ``--enable-expert-parallel`` with more than one rank; a dense model has no
    experts to split)."""
    pc = vllm_config.parallel_config
    hf = model_config.hf_config
    architecture = (getattr(hf, "architectures", None) or [None])[0]
    lay = arch.layout_of(architecture, arch.text_architecture(architecture, hf.to_dict()))
    moe_model = lay.family is not None and lay.family.experts is not None
    ranks = pc.tensor_parallel_size * pc.data_parallel_size
    return bool(moe_model and pc.enable_expert_parallel and ranks > 1)


# --- checks against the engine (before any model memory): runtime/vllm/checks.py ---------------


def _capability() -> int | None:
    from vllm.platforms import current_platform

    cap = current_platform.get_device_capability()
    return cap.to_int() if cap is not None else None


def _engine_facts(vllm_config: Any, model_config: Any) -> dict[str, Any]:
    import vllm
    from vllm.distributed import get_tensor_model_parallel_world_size

    capability = _capability()
    qc = getattr(model_config.hf_config, "quantization_config", None)
    try:
        method = quant_method_of(qc)
        profile = expected_profile(qc, capability)
    except EngineMismatchError as e:
        raise EngineMismatchError(f"{model_config.model}: {e.message}", hint=e.hint) from None
    why = f"vLLM runs this checkpoint with {scheme_class(method, profile)} on sm {capability}"
    text = model_config.hf_config.get_text_config()
    dims = {k: getattr(text, k) for k in MODEL_DIMS if getattr(text, k, None) is not None}
    architecture = (getattr(model_config.hf_config, "architectures", None) or [None])[0]
    pc = vllm_config.parallel_config
    return {
        "version": vllm.__version__,
        "tp_size": get_tensor_model_parallel_world_size(),
        "expert_parallel": _expert_parallel(vllm_config, model_config),
        "data_parallel_size": pc.data_parallel_size,
        "expert_placement": pc.expert_placement_strategy,
        "eplb": bool(pc.enable_eplb),
        "dtype": str(model_config.dtype).removeprefix("torch."),
        "profile": profile,
        "profile_why": why,
        "quant_method": method,
        "model": dims,
        "tied": bool(getattr(text, "tie_word_embeddings", False)),
        "architecture": architecture,
    }


def marlin_layer_names(
    quant_config: Any,
    num_layers: int,
    packed: dict[str, Any],
    prefix: str = arch.DECODER_PREFIX,
    family: arch.Family | None = None,
    config: Mapping[str, Any] | None = None,
) -> set[str]:
    """The linears vLLM will build with an FP8 scheme (so, under ``--load-format mpack``, on
    Marlin) in a model of ``num_layers`` decoder layers, before it builds them.

    vLLM decides per linear, from the checkpoint's quantization config: ``ignore``, then the
    config groups' ``targets`` (names, regexes or class names), a fused linear matching only when
    all its shards do. This asks vLLM's own ``CompressedTensorsConfig.get_scheme_dict`` the
    question it asks while building each layer; it reads only the layer's name and its class's
    name, so a stand-in object of the same class name is enough. The copy of the config gets the
    fused-module mapping ``packed`` that vLLM hands it from the model class at build time (Phi-3's
    maps ``qkv_proj`` to itself: its checkpoint stores it fused). An AutoFP8 config
    (``Fp8Config``) quantizes every linear but those its ``ignored_layers`` name, which vLLM's
    ``is_layer_skipped`` decides. A MoE ``family``'s blocks (where the text ``config`` puts
    them) count with their stacked layers when the config quantizes expert 0's gate, as vLLM's
    compressed-tensors MoE method asks."""
    qc = copy.copy(quant_config)
    qc.packed_modules_mapping = {k: list(v) for k, v in packed.items()}
    config = config or {}
    if not hasattr(qc, "get_scheme_dict"):
        return _fp8_layer_names(qc, num_layers, prefix, family, config)
    names = set()
    for name, gate in moe.block_layers(family, num_layers, prefix, config).items():
        scheme = qc.get_scheme_dict(type("Linear", (), {})(), gate)
        if scheme and scheme.get("weights") is not None:
            names.add(name)
    for name, cls_name in decoder_linears(num_layers, prefix, family, config).items():
        stand_in = type(cls_name, (), {})()
        try:
            scheme = qc.get_scheme_dict(stand_in, name)
        except ValueError as e:  # shards of one fused linear in different schemes
            raise EngineMismatchError(f"{name}: {e}") from None
        if scheme and scheme.get("weights") is not None:
            names.add(name)
    return names


def _fp8_layer_names(
    qc: Any, num_layers: int, prefix: str, family: arch.Family | None, config: Mapping[str, Any]
) -> set[str]:
    """:func:`marlin_layer_names` of an AutoFP8 model (vLLM's ``Fp8Config.get_quant_method``:
    a MoE block's experts are skipped when ``ignored_layers`` names ``<block>.experts``)."""
    from vllm.model_executor.layers.quantization.utils.quant_utils import is_layer_skipped

    names = {
        name
        for name in moe.block_layers(family, num_layers, prefix, config)
        if not is_layer_skipped(
            prefix=name.rsplit(".", 2)[0],  # <block>.experts
            ignored_layers=qc.ignored_layers,
            fused_mapping=qc.packed_modules_mapping,
            match_mode=qc.ignored_layers_match_mode,
        )
    }
    for name in decoder_linears(num_layers, prefix, family, config):
        try:
            skipped = is_layer_skipped(
                prefix=name,
                ignored_layers=qc.ignored_layers,
                fused_mapping=qc.packed_modules_mapping,
                match_mode=qc.ignored_layers_match_mode,
            )
        except ValueError as e:  # shards of one fused linear, some ignored and some not
            raise EngineMismatchError(f"{name}: {e}") from None
        if not skipped:
            names.add(name)
    return names


def _packed_modules(model_config: Any) -> dict[str, Any]:
    """The model class's ``packed_modules_mapping``, as vLLM resolves the class."""
    from vllm.model_executor.model_loader.utils import get_model_architecture

    return dict(getattr(get_model_architecture(model_config)[0], "packed_modules_mapping", {}))


def _as_built(quant_config: Any, model_config: Any) -> Any:
    """A copy of the quantization config with the module names of its ``ignore`` / targets in
    vLLM's names, as vLLM leaves it when it builds the model (``configure_quant_config`` or
    ``SupportsQuant`` apply the class's ``hf_to_vllm_mapper.get_rename_mapper()``): a wrapper's
    checkpoint names (``model.language_model.layers...``) are not its modules' names."""
    from vllm.model_executor.model_loader.utils import get_model_architecture

    mapper = getattr(get_model_architecture(model_config)[0], "hf_to_vllm_mapper", None)
    if mapper is None:
        return quant_config
    qc = copy.copy(quant_config)
    qc.apply_vllm_mapper(mapper.get_rename_mapper())
    return qc


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


# --- the rank's tensors (runtime/vllm/source.py) ------------------------------------------------


def _device_label(target: torch.device) -> str:
    if target.type == "cuda":
        return f"cuda:{target.index if target.index is not None else torch.cuda.current_device()}"
    return "cpu"


# --- the loader ----------------------------------------------------------------------------------

#: How to load a sidecar beside a checkpoint it was not made from (mpack/binding.py).
OVERRIDE_BINDING = """--model-loader-extra-config '{"sidecar": ..., "check_source": false}'"""


@dataclasses.dataclass(frozen=True)
class Checked:
    """A sidecar that agrees with the engine (:func:`checked_sidecar`), and what the load needs
    of it."""

    sidecar: Path
    manifest: dict[str, Any]
    dims: dict[str, int]  # the model's dimensions (MODEL_DIMS), equal to the sidecar's
    tied: bool  # the model's lm_head is its embeddings
    quant_method: str  # the checkpoint's format (a key of mpack.target.QUANT_METHODS)
    #: For a ``--no-passthrough`` sidecar: the checkpoint modules its Marlin layers stand for,
    #: whose tensors vLLM must skip when it reads the checkpoint; None: the sidecar has its own
    #: ``common.safetensors``.
    skip: frozenset[str] | None
    #: The manifest's ``layers`` this pipeline stage runs (Note [a layer range per stage] in
    #: docs/FORMAT.md): all of them at pipeline-parallel size 1.
    layers: dict[str, Any]
    #: This rank's pipeline stage, vLLM's split (:func:`pp_stage`): a one-stage split at
    #: pipeline-parallel size 1.
    stage: arch.Stage


def checked_sidecar(opts: Options, vllm_config: Any, model_config: Any) -> Checked:
    """The sidecar to load, once everything the engine fixes agrees with it, before any model
    memory (Note [the loader trusts nothing in the sidecar] in runtime/vllm/checks.py); the
    model's FP8 linears are then put on Marlin."""
    from vllm.distributed import get_tensor_model_parallel_rank

    engine = _engine_facts(vllm_config, model_config)
    sidecar = sidecar_dir(
        opts,
        model_config.model,
        model_config.revision,
        rank=get_tensor_model_parallel_rank(),
        target=engine_target(engine),
    )
    manifest, _ = load_manifest(sidecar)
    if opts.sidecar and opts.check_source:  # the model argument is the checkpoint
        check_bound(
            manifest,
            model_config.model,
            model_config.revision,
            where=sidecar,
            override=OVERRIDE_BINDING,
        )
    check_target(manifest, engine, sidecar)
    dims = engine["model"]
    lay = layout(manifest)
    expected = marlin_layer_names(
        _as_built(vllm_config.quant_config, model_config),
        dims["num_hidden_layers"],
        _packed_modules(model_config),
        lay.decoder_prefix,
        lay.family,
        model_config.hf_config.get_text_config().to_dict(),
    )
    check_layers(manifest, expected, sidecar)
    stage = pp_stage(dims["num_hidden_layers"])
    experts = any("experts" in ly for ly in manifest["layers"].values())
    has_common = COMMON_NAME in {f["name"] for f in manifest["files"]}
    skip = None
    if has_common:
        common = read_file_map(sidecar / COMMON_NAME, follow=False)
        check_common(
            {e.name: e.shape for e in common.entries},
            layout(manifest),
            manifest["layers"],
            dims,
            engine["tied"],
            sidecar / COMMON_NAME,
        )
    elif not opts.sidecar:  # the model argument is the sidecar: there is no checkpoint
        raise InputError(
            f"{model_config.model}: the sidecar has no {COMMON_NAME} (written with "
            "--no-passthrough), so vLLM has no embeddings, norms or lm_head to load",
            hint="pass the original checkpoint as the model and "
            '--model-loader-extra-config \'{"sidecar": "PATH"}\'',
        )
    else:
        skip = frozenset(check_shards(manifest, sidecar))
    if experts:
        moe.force_marlin_moe(vllm_config)
    force_marlin(vllm_config)
    return Checked(
        sidecar,
        manifest,
        dims,
        engine["tied"],
        engine["quant_method"],
        skip,
        arch.stage_layers(manifest["layers"], stage.layers, lay.decoder_prefix),
        stage,
    )


def pp_stage(num_layers: int) -> arch.Stage:
    """This rank's pipeline stage, whose ``layers`` are the decoder layers it runs: the split
    is vLLM's own ``get_pp_indices`` for every stage, the rule its ``make_layers`` builds the
    model by (``VLLM_PP_LAYER_PARTITION`` included; mpack's copy of it is
    :func:`mpack.arch.pp_layers`). One stage of every layer at pipeline-parallel size 1."""
    from vllm.distributed import get_pp_group
    from vllm.distributed.utils import get_pp_indices

    pp = get_pp_group()
    split = tuple(
        len(range(*get_pp_indices(num_layers, r, pp.world_size))) for r in range(pp.world_size)
    )
    return arch.Stage(pp.rank_in_group, split)


class Phases:
    """Where a load spends its time: host seconds per named phase, for the log and the
    benchmarks (``model._mpack_load``)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = round(time.perf_counter() - t0, 4)


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

    def get_external_weight_memory(self, vllm_config: Any) -> int:
        """The bytes of this rank's weights held outside the engine, by the daemon it will
        attach to: vLLM counts them inside ``--gpu-memory-utilization`` (as it does for its own
        weight cache), so that the fraction means what it means for an ordinary engine, and an
        engine beside a daemon holding most of the GPU still starts. 0 when the engine will load
        privately (``attach: never``, or no daemon serves the sidecar); a sidecar the engine would
        refuse is ``load_model``'s to refuse, with its full error."""
        from mpack.runtime.client import served_bytes

        gc.freeze()  # vLLM has just collected: Note [the heap frozen for vLLM's collections]
        if self.options.attach == "never":
            return 0
        from vllm.distributed import get_tensor_model_parallel_rank

        model_config = vllm_config.model_config
        load_device = vllm_config.load_config.device or vllm_config.device_config.device
        rank = get_tensor_model_parallel_rank()
        try:
            engine = _engine_facts(vllm_config, model_config)
            sidecar = sidecar_dir(
                self.options,
                model_config.model,
                model_config.revision,
                rank=rank,
                target=engine_target(engine),
            )
            return served_bytes(
                sidecar,
                rank=rank,
                device=_device_label(torch.device(load_device)),
                socket=self.options.socket,
                stage=pp_stage(engine["model"]["num_hidden_layers"]),
            )
        except MpackError:
            return 0

    def download_model(self, model_config: Any) -> None:
        """Fetch the sidecar ahead of ``load_model`` (every rank's files: this call has no
        rank), at the current engine's target when a config is set."""
        from vllm.config import get_current_vllm_config_or_none

        cfg = get_current_vllm_config_or_none()
        target = None
        if cfg is not None and cfg.model_config is not None:
            qc = getattr(model_config.hf_config, "quantization_config", None)
            with contextlib.suppress(MpackError, TypeError, AttributeError):
                target = {
                    "tp_size": cfg.parallel_config.tensor_parallel_size,
                    "profile": expected_profile(qc, _capability()),
                    "act_dtype": str(model_config.dtype).removeprefix("torch."),
                    "fusion": "vllm",
                    **({EXPERT_PARALLEL: True} if _expert_parallel(cfg, model_config) else {}),
                }
        sidecar_dir(self.options, model_config.model, model_config.revision, target=target)

    def load_weights(self, model: nn.Module, model_config: Any) -> None:
        checked = getattr(model, "_mpack_checked", None)
        if checked is None:
            raise MpackError("--load-format mpack loads weights only through load_model")
        self._load_rest(model, model_config, checked, model._mpack_weights)

    # Note [the heap frozen for vLLM's collections]: vLLM's worker runs a full ``gc.collect()``
    # before it asks ``get_external_weight_memory``, and its "Model loading took" is timed around
    # ``DeviceMemoryProfiler``, which runs one more as it enters and two as it leaves. Each walks
    # every object the process tracks (vLLM's, torch's and their imports'; 0.3-0.6 s each with
    # vLLM imported), and none of them is garbage: vLLM itself freezes that heap once the engine
    # is up (``freeze_gc_heap`` in its engine core and worker) so that no later collection walks
    # it again. The loader freezes it a little earlier, each time just after one of vLLM's own
    # collections: when vLLM asks ``get_external_weight_memory``, and as ``load_model`` starts.
    # The collections around the load then walk only what was made since. Beyond the time, one
    # thing changes: cyclic garbage made of objects alive at a freeze waits for vLLM's
    # ``gc.unfreeze()`` at shutdown instead of a collection (vLLM's own freeze, moments later,
    # does the same to what is alive then).
    def load_model(self, vllm_config: Any, model_config: Any, prefix: str = "") -> nn.Module:
        from vllm.distributed import get_tensor_model_parallel_rank

        gc.freeze()  # Note [the heap frozen for vLLM's collections]
        phases = Phases()
        with phases("checks"):
            checked = checked_sidecar(self.options, vllm_config, model_config)
        load_device = vllm_config.load_config.device or vllm_config.device_config.device
        target = torch.device(load_device)
        rank = get_tensor_model_parallel_rank()
        with phases("weights"):
            weights = rank_weights(
                checked.sidecar, self.options, rank, _device_label(target), checked.stage
            )
        try:
            if checked.skip is None:  # the tensors loaded are those whose header was checked
                check_common(
                    _common_shapes(weights),
                    layout(checked.manifest),
                    checked.manifest["layers"],
                    checked.dims,
                    checked.tied,
                    checked.sidecar / COMMON_NAME,
                    weights.stage,  # a stage's weights hold its tensors of the file
                )
            with set_default_torch_dtype(model_config.dtype):
                with phases("build"), target, building(checked.skip is None) as ph:
                    model = self.create_model(vllm_config, model_config, prefix)
                model._mpack_weights = weights  # the lease and mappings live with the model
                model._mpack_checked = checked
                with phases("marlin"):
                    stage = {**checked.manifest, "layers": checked.layers}
                    layers = _swap_in(model, stage, weights, checked.sidecar, checked.quant_method)
                with phases("rest"):
                    self._load_rest(model, model_config, checked, weights, layers, ph)
                with phases("process"):
                    _process_others(
                        model, layers, model_config, target, process_weights_after_loading
                    )
                ph.check_replaced(model)
        except BaseException:
            weights.close()
            raise
        model._mpack_load = {
            "seconds": phases.seconds,
            "placeholder_bytes": ph.bytes_saved,
            "materialized": list(ph.materialized),
        }
        # one line per rank: where the part of vLLM's "Model loading took" that is mpack's went
        logger().info(
            "mpack: load phases (s): %s",
            ", ".join(f"{k} {v:.3f}" for k, v in phases.seconds.items()),
        )
        return model.eval()

    def _load_rest(
        self,
        model: nn.Module,
        model_config: Any,
        checked: Checked,
        weights: Any,
        layers: dict[str, nn.Module] | None = None,
        placeholders: Placeholders | None = None,
    ) -> None:
        """Every non-Marlin tensor, through vLLM's own weight loaders; then, at load time
        (``layers`` given), every parameter of the model must have been loaded."""
        source = checked.sidecar / COMMON_NAME if checked.skip is None else Path(model_config.model)
        last: list[str] = []  # the tensor vLLM was given last: the one it failed on
        # the sidecar's pass-through tensors used in place where vLLM would copy them as they
        # are (runtime/vllm/inplace.py); a checkpoint's (--no-passthrough) are vLLM's to copy
        in_place = (
            InPlace(placeholders=placeholders or Placeholders())
            if checked.skip is None and layers is not None
            else None
        )

        def tensors() -> Iterator[tuple[str, torch.Tensor]]:
            for name, t in _rest_of_model(self, model, model_config, checked, weights):
                last[:] = [name]
                yield name, t

        wrapped = (
            in_place.loading(model, layers.values())  # type: ignore[union-attr]
            if in_place is not None
            else contextlib.nullcontext()
        )
        try:
            with wrapped:
                loaded = model.load_weights(
                    tensors() if in_place is None else in_place.feed(tensors())
                )
        except torch.OutOfMemoryError:
            raise  # the machine's fault, not the file's
        except (AssertionError, ValueError, RuntimeError, KeyError, IndexError, TypeError) as e:
            # vLLM's weight loaders assert and index what they are given: a file that does
            # not fit this model ends in one of these, deep inside vLLM.
            at = f" at tensor {shown(last[0])}" if last else ""
            raise CorruptFileError(
                f"{source}: vLLM could not load it into this model{at}: "
                f"{type(e).__name__}: {shown(str(e))}",
                hint=OTHER_MODEL_HINT,
            ) from e
        if in_place is not None:
            model._mpack_passthrough = in_place.report()
            _log_passthrough(model._mpack_passthrough)
        if layers is not None:
            _check_all_loaded(model, loaded, layers, source)


def _log_passthrough(r: dict[str, Any]) -> None:
    """One line per rank: the pass-through tensors used in place, and those copied, named."""
    copied = r["copied"]
    named = f": {', '.join(copied[:4])}{' ...' if len(copied) > 4 else ''}" if copied else ""
    logger().info(
        "mpack pass-through: %d tensors (%.1f MiB) used in place, %d copied (%.1f MiB)%s",
        r["in_place"],
        r["in_place_bytes"] / 2**20,
        len(copied),
        r["copied_bytes"] / 2**20,
        named,
    )


def _common_shapes(weights: Any) -> dict[str, tuple[int, ...]]:
    """The tensors of the loaded ``common.safetensors``: every tensor not in the rank file."""
    in_rank_file = expected_rank_tensors(weights.manifest)
    return {n: tuple(weights[n].shape) for n in weights if n not in in_rank_file}


def _check_all_loaded(
    model: nn.Module, loaded: Any, layers: dict[str, nn.Module], source: Path
) -> None:
    """Every parameter of the model has its bytes from the sidecar or from ``source``.

    vLLM runs this check itself only for unquantized models (``track_weights_loading``): on a
    quantized one, a parameter nobody loaded keeps uninitialised memory. The exemptions are
    vLLM's: the KV-cache scales an FP8 checkpoint may leave out (they default to 1), empty
    placeholders, and parameters the quantization config builds. The Marlin layers' parameters
    came from the sidecar (:func:`_swap_in` checked each of them)."""
    from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod
    from vllm.model_executor.model_loader.default_loader import _CONFIG_BUILT_PARAMS

    if not isinstance(loaded, set):
        raise MpackError(
            f"{type(model).__name__}.load_weights did not say which weights it loaded, so "
            "--load-format mpack cannot check that every one was"
        )
    done = set(loaded)
    held = set(layers.values())
    for name, module in model.named_modules():
        exempt = module in held or isinstance(
            getattr(module, "quant_method", None), BaseKVCacheMethod
        )
        for pname, p in module.named_parameters(recurse=False):
            if exempt or p.numel() == 0 or pname in _CONFIG_BUILT_PARAMS:
                done.add(f"{name}.{pname}" if name else pname)
    missing = sorted(
        (n for n, _ in model.named_parameters() if n not in done), key=arch.natural_key
    )
    if missing:
        raise InputError(
            f"{source}: has no tensor for {len(missing)} parameter(s) of the model, "
            f"{', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}: vLLM would run "
            "them from uninitialised memory",
            hint=OTHER_MODEL_HINT,
        )


def _scheme_kernel(layer: nn.Module) -> tuple[Any, Any]:
    """A layer's quantization scheme and its kernel: compressed-tensors' ``layer.scheme``, or an
    AutoFP8 layer's ``Fp8LinearMethod`` (its quant method, which holds ``fp8_linear``); None for
    an unquantized layer."""
    scheme = getattr(layer, "scheme", None)
    if scheme is None and hasattr(getattr(layer, "quant_method", None), "fp8_linear"):
        scheme = layer.quant_method
    kernel = getattr(scheme, "linear_kernel", None) or getattr(scheme, "fp8_linear", None)
    return scheme, kernel


# Note [loading from a sidecar]: each parameter keeps its vLLM ``Parameter`` object (and with it
# its weight loader), and its ``.data`` becomes the sidecar's tensor itself: with an attached
# sidecar a view of the daemon's read-only mapping, never a copy. ``input_scale`` is removed and
# the rest of the state set as Marlin's own processing leaves it (:func:`_as_processed`).
def _swap_in(
    model: nn.Module, manifest: dict[str, Any], weights: Any, sidecar: Path, quant_method: str
) -> dict[str, nn.Module]:
    """Give every Marlin layer the sidecar's tensors; return the layers by name (Note [loading
    from a sidecar])."""
    from vllm.model_executor.kernels.linear.scaled_mm.marlin import MarlinFP8ScaledMMLinearKernel

    modules = dict(model.named_modules())
    want = scheme_class(quant_method, manifest["target"]["profile"])
    dense = {n: ly for n, ly in manifest["layers"].items() if "experts" not in ly}
    # a MoE block's two stacked layers fill one module (runtime/vllm/moe.py)
    owners = {n.rpartition(".")[0] for n in manifest["layers"] if n not in dense}
    _check_same_layers(modules, set(dense) | owners, sidecar)
    held: dict[str, nn.Module] = {}
    for name, ly in manifest["layers"].items():
        if name not in dense:
            owner = moe.experts_module(modules, name, quant_method, sidecar)
            moe.swap_in(owner, name, ly, weights, sidecar)
            held[name.rpartition(".")[0]] = owner
    for name, ly in dense.items():
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
        layer._parameters.pop("input_scale", None)  # Marlin's own processing drops it
        with contextlib.suppress(AttributeError):
            delattr(layer, "input_scale")
        params = {k: p for k, p in layer.named_parameters(recurse=False)}
        leaves = {
            leaf for leaf in ("weight", "weight_scale", "bias") if f"{name}.{leaf}" in weights
        }
        if set(params) != leaves:  # the rank file's tensors are the manifest's (load/attach)
            raise EngineMismatchError(
                f"{sidecar}: layer {name} has parameters {', '.join(sorted(params))} in the "
                f"model, {', '.join(sorted(leaves))} in the sidecar"
                + (" (the layer's bias differs)" if "bias" in set(params) ^ leaves else ""),
                hint=OTHER_MODEL_HINT,
            )
        for leaf, param in params.items():
            param.data = weights[f"{name}.{leaf}"]
        _as_processed(layer, scheme, kernel, ly)
    return {**{name: modules[name] for name in dense}, **held}


def _check_same_layers(modules: dict[str, nn.Module], layers: set[str], sidecar: Path) -> None:
    """Refuse a model (its ``modules`` by name) whose FP8 layers are not the sidecar's
    ``layers`` (the modules its layers fill: a dense layer's own, a MoE block's experts'): one
    of them missing from the model, or a layer with a quantization scheme (or an FP8 MoE
    method) that the sidecar has no weights for."""
    missing = sorted((n for n in layers if n not in modules), key=arch.natural_key)
    if missing:
        raise EngineMismatchError(
            f"{sidecar}: the model has no layer {first_and_more(missing)}: the sidecar was made "
            "for another model",
            hint=OTHER_MODEL_HINT,
        )
    # Every layer vLLM built with a quantization scheme runs on Marlin (force_marlin) and must
    # get the sidecar's weights: vLLM would otherwise repack uninitialised memory.
    uncovered = sorted(
        (
            n
            for n, m in modules.items()
            if (_scheme_kernel(m)[0] is not None or moe.is_fp8_moe(m)) and n not in layers
        ),
        key=arch.natural_key,
    )
    if uncovered:
        raise EngineMismatchError(
            f"{sidecar}: the sidecar has no weights for layer {first_and_more(uncovered)}, which "
            "this model runs on FP8 Marlin",
            hint=OTHER_MODEL_HINT,
        )


def _as_processed(layer: nn.Module, scheme: Any, kernel: Any, ly: dict[str, Any]) -> None:
    """What vLLM's Marlin processing leaves on the layer and its scheme beyond the tensors: an
    AutoFP8 layer's kernel gets the method's Marlin input dtype (fp8.py); a compressed-tensors
    layer says its weight keeps the checkpoint's dims (``processed_weight_dims``), and a
    per-tensor W8A16 one's scales become per-channel (schemes/compressed_tensors_w8a16_fp8.py)."""
    if type(scheme).__name__ == scheme_class("fp8", "w8a16"):
        kernel.marlin_input_dtype = scheme.marlin_input_dtype
        return
    layer.processed_weight_dims = (0, 1)
    if type(scheme).__name__ != scheme_class("compressed-tensors", "w8a16"):
        return
    if ly.get("strategy") != "tensor":
        return
    from compressed_tensors.quantization import QuantizationStrategy
    from vllm.model_executor.layers.quantization.compressed_tensors.utils import (
        STRATEGY_TO_WEIGHT_QUANT_KEY,
    )

    scheme.weight_quant_key = STRATEGY_TO_WEIGHT_QUANT_KEY[QuantizationStrategy.CHANNEL]
    scheme.linear_kernel.config.weight_quant_key = scheme.weight_quant_key


def _rest_of_model(
    loader: Any, model: nn.Module, model_config: Any, checked: Checked, weights: Any
) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors vLLM loads itself: ``common.safetensors`` from the sidecar's allocation, or,
    for a sidecar written with ``--no-passthrough``, the checkpoint's tensors other than the
    Marlin layers' (``checked.skip``: the checkpoint modules their ``shards`` name). An
    expert's static ``input_scale`` is vLLM's to load (the block keeps their maximum), as
    ``common.safetensors`` passes it through."""
    if checked.skip is None:
        in_rank_file = expected_rank_tensors(weights.manifest)
        for name in weights:
            if name not in in_rank_file:
                yield name, weights[name]
        return
    experts = layout(checked.manifest).family.experts  # type: ignore[union-attr]
    for name, tensor in loader.get_all_weights(model_config, model):
        module, _, leaf = name.rpartition(".")
        expert_input = leaf == "input_scale" and experts is not None and experts.expert_of(module)
        if module not in checked.skip or expert_input:
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
            if hasattr(layer, "update_param_tp_status"):
                layer.update_param_tp_status()
    for layer in held:
        if moe.is_fp8_moe(layer):
            moe.finish(layer)
    with contextlib.suppress(RuntimeError):
        torch.accelerator.empty_cache()


__all__ = [
    "MARLIN_QUANT_KEYS",
    "Checked",
    "MpackModelLoader",
    "checked_sidecar",
    "engine_target",
    "force_marlin",
    "marlin_layer_names",
    "pp_stage",
]
