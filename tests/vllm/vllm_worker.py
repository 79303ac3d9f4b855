"""One TP rank of vLLM 0.33.0 on the CPU: build real models, load them, digest every tensor.

usage: python vllm_worker.py JOB.json RANK

The parent (test_vllm_loader.py) starts one process per rank of ``job["tp"]`` times
``job["pp"]`` (pipeline stages, 1 when absent), all with the same job; they meet over gloo on
``127.0.0.1:job["port"]``, and vLLM's ``initialize_model_parallel`` makes rank ``R`` TP rank
``R % tp`` of stage ``R // tp``, as a multiprocessing engine does. The job::

    {"tp": 2, "pp": 1, "port": 29517, "out_dir": DIR,
     "loads": [{"id": "llama-t/default",          # a name for the results
                "model": CKPT_OR_SIDECAR_DIR,      # EngineArgs(model=...)
                "profile": "w8a16",                # capability the engine sees (cpu_standins)
                "dtype": "bfloat16",               # EngineArgs(dtype=...)
                "load_format": "auto" | "mpack",   # "auto": vLLM's DefaultModelLoader
                "extra": {...},                    # model_loader_extra_config, or absent
                "sidecar": DIR,                    # the sidecar the load uses (for the views check)
                "env": {"XDG_RUNTIME_DIR": ...}},  # set for this load only
               ...]}

Distributed is set up once; every load then builds a fresh engine config (a model registers
its attention layers in its config: two models cannot share one) and runs
``get_model_loader(load_config).load_model(...)``. Writes ``out_dir/rank-R.json``, by load id:

* ``{"ok": true, "seconds", "tensors": {name: {kind, cls, shape, dtype, sha256}}, "weights",
  "marlin": {name: {same_ptr, same_storage, in_mapping, region, perms}}}``: every named parameter
  and buffer; for an mpack load, the ``SharedWeights`` the loader exposes as
  ``model._mpack_weights`` (backend, device, nbytes) and, for every tensor of the sidecar's rank
  file, whether the model's parameter is that tensor (same address, same storage, inside the
  allocation) and the ``/proc/self/maps`` region and permissions it lies in;
* ``{"ok": false, "error": {type, mro, message, hint, linear_layers_built}, "traceback"}``:
  ``linear_layers_built`` counts vLLM ``LinearBase`` layers constructed before the error (0:
  refused before any model memory was allocated).

``_plugin_registered``: whether vLLM's plugin loading (``vllm.general_plugins``, run by
``EngineArgs``) registered load format ``mpack`` by itself, as it does in every vLLM process of a
real deployment; ``mpack.runtime.vllm.register()`` is then called anyway (idempotent), so the
loads also run where mpack is importable without being installed (no entry points).

``main()`` installs the CPU stand-ins (``cpu_standins.install()``) before anything imports vLLM;
importing this module installs nothing, so scripts/vllm_gpu.py shares its helpers on a GPU.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

# cpu_standins is the file beside this one: run as a script, its folder is first on sys.path
# (scripts/vllm_gpu.py puts it there before importing this module).
import cpu_standins
import torch
from torch import nn

LEAVES = ("weight", "weight_scale", "bias")


def digest(t: torch.Tensor) -> str:
    raw = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    return hashlib.sha256(raw.numpy().tobytes()).hexdigest()


def tensors_of(model: nn.Module) -> dict[str, dict[str, Any]]:
    out = {}
    for kind, items in (("param", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, t in items:
            out[name] = {
                "kind": kind,
                "cls": type(t).__name__,
                "shape": list(t.shape),
                "dtype": str(t.dtype).removeprefix("torch."),
                "sha256": digest(t),
            }
    return out


_PLAIN = (bool, int, float, str, type(None), torch.dtype)


def _value(v: Any) -> str:
    """A value by its repr where that says what it holds (simple values, lists and tuples of
    them, dataclasses and enums such as vLLM's quantization keys), else by its class name (a
    repr with an address would differ between any two loads)."""
    if isinstance(v, (list, tuple)):
        return f"{type(v).__name__}({', '.join(_value(x) for x in v)})"
    r = repr(v)
    if isinstance(v, _PLAIN) or (type(v).__repr__ is not object.__repr__ and " at 0x" not in r):
        return r
    return f"<{type(v).__name__}>"


def _plain_state(obj: Any) -> dict[str, str]:
    """``obj``'s public attributes that are not tensors or modules, by :func:`_value`."""
    return {
        k: _value(v)
        for k, v in sorted(vars(obj).items())
        if not k.startswith("_") and not isinstance(v, (torch.Tensor, nn.Module))
    }


def layer_state(model: nn.Module) -> dict[str, dict[str, Any]]:
    """What vLLM's post-load processing leaves on every layer with a quantization scheme, other
    than its tensors (those are :func:`tensors_of`'s): the layer's, its scheme's, its kernel's
    and the kernel config's plain attributes, and which tensor attributes it has (a parameter,
    a plain tensor such as a workspace, or None). The scheme of an AutoFP8 layer is its quant
    method, ``Fp8LinearMethod`` (which holds the kernel, ``fp8_linear``)."""
    out: dict[str, dict[str, Any]] = {}
    for name, m in model.named_modules():
        qm = getattr(m, "quant_method", None)
        if hasattr(qm, "fp8_backend"):  # a MoE block's experts (runtime/vllm/moe.py)
            out[name] = {
                "layer": _plain_state(m),
                "method": {
                    **_plain_state(qm),
                    "fp8_backend": str(qm.fp8_backend),
                    "moe_quant_config": type(getattr(qm, "moe_quant_config", None)).__name__,
                    "moe_kernel": type(getattr(qm, "moe_kernel", None)).__name__,
                },
                "tensors": _tensor_kinds(m),
            }
            continue
        scheme = getattr(m, "scheme", None)
        if scheme is None and hasattr(getattr(m, "quant_method", None), "fp8_linear"):
            scheme = m.quant_method
        if scheme is None:
            continue
        kernel = getattr(scheme, "linear_kernel", None) or getattr(scheme, "fp8_linear", None)
        rec: dict[str, Any] = {"layer": _plain_state(m), "scheme": _plain_state(scheme)}
        if kernel is not None:
            rec["kernel"] = _plain_state(kernel)
            rec["kernel.config"] = _plain_state(getattr(kernel, "config", object()))
        rec["tensors"] = _tensor_kinds(m)
        out[name] = rec
    return out


def _tensor_kinds(m: nn.Module) -> dict[str, str]:
    """Which tensor attributes a module has: a parameter, a plain tensor, or None."""
    return {
        k: type(v).__name__
        for k, v in sorted({**vars(m), **m._parameters, **m._buffers}.items())
        if not k.startswith("_") and (isinstance(v, torch.Tensor) or v is None)
    }


def maps() -> list[tuple[int, int, str, str]]:
    """``/proc/self/maps`` as (start, end, perms, path)."""
    out = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        a, b = (int(x, 16) for x in parts[0].split("-"))
        out.append((a, b, parts[1], parts[5] if len(parts) > 5 else ""))
    return out


def region_of(ptr: int, regions: list[tuple[int, int, str, str]]) -> tuple[str, str]:
    for a, b, perms, path in regions:
        if a <= ptr < b:
            return perms, path
    return "", "(unmapped)"


def marlin_views(model: nn.Module, sidecar: str | None) -> tuple[dict | None, dict]:
    """The loader's ``SharedWeights`` and, per rank-file tensor, where the model's copy lies."""
    from mpack.sidecar import load_manifest

    weights = getattr(model, "_mpack_weights", None)
    info = None
    if weights is not None:
        info = {
            "type": type(weights).__name__,
            "backend": getattr(weights, "backend", None),
            "device": getattr(weights, "device", None),
            "nbytes": getattr(weights, "nbytes", None),
        }
    if sidecar is None:
        return info, {}
    manifest, _ = load_manifest(sidecar)
    regions = maps()
    out = {}
    for layer in manifest["layers"]:
        for leaf in LEAVES:
            name = f"{layer}.{leaf}"
            try:
                p = model.get_parameter(name)
            except AttributeError:
                continue
            rec: dict[str, Any] = {"ptr": p.data_ptr()}
            rec["perms"], rec["region"] = region_of(p.data_ptr(), regions)
            if weights is not None and name in weights:
                w = weights[name]
                base, size = w.untyped_storage().data_ptr(), w.untyped_storage().nbytes()
                rec["same_ptr"] = p.data_ptr() == w.data_ptr()
                rec["same_storage"] = p.untyped_storage().data_ptr() == base
                rec["in_mapping"] = base <= p.data_ptr() and p.data_ptr() + p.nbytes <= base + size
            out[name] = rec
    return info, out


def outside_sidecar(model: nn.Module) -> list[str] | None:
    """The model's parameters whose bytes are not in the sidecar's tensors (the loader's
    ``_mpack_weights``: the daemon's mapping or the private load); None for vLLM's own load."""
    weights = getattr(model, "_mpack_weights", None)
    if weights is None:
        return None
    spans = {
        (w.untyped_storage().data_ptr(), w.untyped_storage().nbytes())
        for w in (weights[n] for n in weights)
    }
    out = []
    for name, p in model.named_parameters():
        at, end = p.data_ptr(), p.data_ptr() + p.numel() * p.element_size()
        if p.numel() and not any(b <= at and end <= b + n for b, n in spans):
            out.append(name)
    return out


def marlin_bytes(model: nn.Module) -> int | None:
    """The bytes of the model's parameters that are the rank file's tensors (the Marlin layers'
    and MoE blocks'); None for vLLM's own load."""
    weights = getattr(model, "_mpack_weights", None)
    if weights is None:
        return None
    from mpack.sidecar import expected_rank_tensors

    in_rank_file = expected_rank_tensors(weights.manifest)
    return sum(p.nbytes for n, p in model.named_parameters() if n in in_rank_file)


def built_layers(model: nn.Module) -> list[int] | None:
    """The decoder layers ``[start, end)`` the model's pipeline stage built (vLLM's
    ``make_layers``); None for a model that keeps them elsewhere (a wrapper's)."""
    inner = getattr(model, "model", None)
    return [inner.start_layer, inner.end_layer] if hasattr(inner, "start_layer") else None


class LinearCount:
    """Counts vLLM ``LinearBase`` layers built: a model refused before allocation built none."""

    n = 0

    @classmethod
    def install(cls) -> None:
        from vllm.model_executor.layers.linear import LinearBase

        init = LinearBase.__init__

        def counted(self: Any, *a: Any, **kw: Any) -> None:
            cls.n += 1
            init(self, *a, **kw)

        LinearBase.__init__ = counted


@contextlib.contextmanager
def env(overrides: dict[str, str] | None):
    saved = {k: os.environ.get(k) for k in overrides or {}}
    os.environ.update(overrides or {})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def engine_config(load: dict[str, Any], tp: int, **overrides: Any) -> Any:
    """The engine config of one load; ``overrides`` replace or add ``EngineArgs`` arguments."""
    from vllm.engine.arg_utils import EngineArgs

    cpu_standins.set_profile(load["profile"])
    kw: dict[str, Any] = {}
    if load.get("load_format", "auto") != "auto":
        kw["load_format"] = load["load_format"]
    if load.get("extra") is not None:
        kw["model_loader_extra_config"] = load["extra"]
    args = dict(
        model=load["model"],
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype=load["dtype"],
        max_model_len=256,
        tensor_parallel_size=tp,
        linear_backend="marlin" if load["profile"] == "w8a8-marlin" else "auto",
        moe_backend="marlin",  # MoE models' experts (mpack's layout is Marlin's)
        **kw,
    )
    # a load's own engine arguments (enable_expert_parallel), then the caller's
    return EngineArgs(**{**args, **load.get("engine_args", {}), **overrides}).create_engine_config()


def build(cfg: Any) -> nn.Module:
    """``get_model_loader(...).load_model(...)`` under ``cfg``: the loaded model."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader

    with set_current_vllm_config(cfg):
        return get_model_loader(cfg.load_config).load_model(
            vllm_config=cfg, model_config=cfg.model_config
        )


def external_weight_memory(cfg: Any) -> int:
    """What vLLM's worker asks the loader before it loads: the bytes held outside the engine."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader

    with set_current_vllm_config(cfg):
        return get_model_loader(cfg.load_config).get_external_weight_memory(cfg)


def run_load(load: dict[str, Any], tp: int, pp: int = 1) -> dict[str, Any]:
    t0 = time.perf_counter()
    LinearCount.n = 0
    model = None
    try:
        with env(load.get("env")):
            cfg = engine_config(load, tp, **({"pipeline_parallel_size": pp} if pp > 1 else {}))
            frozen = gc.get_freeze_count()
            external = external_weight_memory(cfg)
            model = build(cfg)
            seconds = time.perf_counter() - t0
            frozen = gc.get_freeze_count() - frozen
            info, views = marlin_views(model, load.get("sidecar"))
            return {
                "ok": True,
                "seconds": seconds,
                "tensors": tensors_of(model),
                "state": layer_state(model),
                "weights": info,
                "marlin": views,
                "passthrough": getattr(model, "_mpack_passthrough", None),
                "outside_sidecar": outside_sidecar(model),
                "load": getattr(model, "_mpack_load", None),
                "external_weight_memory": external,
                "frozen_by_load": frozen,  # objects the query and the load froze (gc.freeze)
                "marlin_bytes": marlin_bytes(model),
                "layers": built_layers(model),
            }
    except Exception as e:
        return {
            "ok": False,
            "seconds": time.perf_counter() - t0,
            "error": {
                "type": type(e).__name__,
                "mro": [c.__name__ for c in type(e).__mro__],
                "message": str(e),
                "hint": getattr(e, "hint", None),
                "linear_layers_built": LinearCount.n,
            },
            "traceback": traceback.format_exc(),
        }
    finally:
        weights = getattr(model, "_mpack_weights", None)
        if weights is not None and hasattr(weights, "close"):
            weights.close()
        del model
        gc.collect()


#: What mpack.runtime.warm() imports for the first attach (Note [warm attach]).
WARMED = ("mpack.hub_sidecar", "mpack.runtime.client", "mpack.runtime.memfd")


def join_world(cfg: Any, tp: int, pp: int, rank: int, port: int) -> None:
    """Rank ``rank`` of ``tp`` x ``pp`` over gloo on ``127.0.0.1:port``, TP and PP groups made
    as vLLM's engine makes them."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    with set_current_vllm_config(cfg):
        init_distributed_environment(
            world_size=tp * pp,
            rank=rank,
            local_rank=rank,
            distributed_init_method=f"tcp://127.0.0.1:{port}",
            backend="gloo",
        )
        initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)


def main(job_path: str, rank: int) -> int:
    cpu_standins.install()  # before anything imports vLLM
    job = json.loads(Path(job_path).read_text())
    tp, pp = job["tp"], job.get("pp", 1)
    torch.set_num_threads(1)  # one process per rank on a small machine

    t0 = time.perf_counter()
    LinearCount.install()
    from vllm.model_executor.model_loader import _LOAD_FORMAT_TO_MODEL_LOADER

    first = dict(job["loads"][0], load_format="auto", extra=None)  # any config will do
    # EngineArgs loads vLLM's general plugins
    cfg = engine_config(first, tp, **({"pipeline_parallel_size": pp} if pp > 1 else {}))
    plugin_registered = "mpack" in _LOAD_FORMAT_TO_MODEL_LOADER
    warmed = [m for m in WARMED if m in sys.modules]  # by the plugin, before any load
    from mpack.runtime.vllm import register

    register()
    join_world(cfg, tp, pp, rank, job["port"])
    setup = time.perf_counter() - t0

    results: dict[str, Any] = {
        "_setup_seconds": setup,
        "_plugin_registered": plugin_registered,
        "_warmed": warmed,
    }
    for load in job["loads"]:
        results[load["id"]] = run_load(load, tp, pp)
    out = Path(job["out_dir"]) / f"rank-{rank}.json"
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=1))
    tmp.rename(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2])))
