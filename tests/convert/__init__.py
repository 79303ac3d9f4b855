"""Conversion: planning, repacking, the streaming driver and its output (mpack.convert)."""
