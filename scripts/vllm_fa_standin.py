"""Stand-in for ``vllm/vllm_flash_attn/__init__.py`` on the device (scripts/device_vllm.sh).

vLLM's flash-attention extensions (``_vllm_fa2_C`` / ``_vllm_fa3_C``, 480 MB) do not travel to
the device, and the real module refuses to import without them, which vLLM's model loader and
its model-inspection subprocess need. This module says FlashAttention is unsupported, so models
use the Triton attention backend (asked for explicitly); linear layers, the Marlin ops and the
loaders stay vLLM's own, compiled.
"""

FA2_AVAILABLE = False
FA3_AVAILABLE = False


def _unsupported(*args, **kwargs):
    raise NotImplementedError("flash attention is not on this machine (stand-in)")


flash_attn_varlen_func = get_scheduler_metadata = _unsupported
compile_flash_attn_varlen_func_from_specs = _unsupported


def is_fa_version_supported(*args, **kwargs):
    return False


def fa_version_unsupported_reason(*args, **kwargs):
    return "flash attention stand-in (the extensions are not on this machine)"
