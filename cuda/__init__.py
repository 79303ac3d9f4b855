"""CUDA sources shipped with mpack (compiled on demand with NVRTC by mpack.convert.cuda_repack)."""
