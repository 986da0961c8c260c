"""Offload storage: the offload folder's format and index, and the loader that serves offloaded weights."""
