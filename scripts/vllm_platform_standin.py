"""Stand-in (device only): vLLM's own ``CudaPlatform``, chosen through vLLM's platform plugins.

vLLM 0.33.0 picks its platform on first use of ``vllm.platforms.current_platform``. Its CUDA
probe (``cuda_platform_plugin``) asks NVML for a GPU count; on the device that probe has failed
(vLLM then resolves ``UnspecifiedPlatform``, whose ``marlin_gemm`` has no CUDA kernel), while
torch and nvidia-smi see the H200. scripts/device_vllm.sh installs this module with an entry
point in the ``vllm.platform_plugins`` group only when vLLM's own probe does not give CUDA.
The class returned is vLLM's, unchanged: ``vllm.platforms.cuda`` itself picks its NVML or
non-NVML variant. Nothing on the weights' path (loading, Marlin processing, the GEMM) changes.
"""


def cuda() -> str:
    return "vllm.platforms.cuda.CudaPlatform"
