"""Verification: the checks and the one-pass comparison with the source (mpack.verify)."""
