"""Errors of the paged KV cache (kept here so `kv/` depends on nothing else in specmesh)."""


class OutOfBlocksError(RuntimeError):
    """The KV pool has no free block left; services map it to RESOURCE_EXHAUSTED."""
