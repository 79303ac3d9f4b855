"""Hostile inputs: damaged sidecars, caches, peers and outputs, each refused with a clear error."""
