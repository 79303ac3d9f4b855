"""Verification: checksums, re-derivation from the source, and forward equivalence (docs/ARCHITECTURE.md)."""
