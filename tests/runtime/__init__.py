"""The runtime: wire protocol, loader, CUDA VMM and the serve/attach daemon (mpack.runtime)."""
