"""The storage-backend plugin API, re-exported for plugin authors.

It is defined in `kvstore.backend` because kvtier's own tiers (the disk, Redis, the memory reference)
are backends, and `kvstore` must not import `connectors`.
"""
from kvstore.backend import (BackendError, BackendStats, Buffer, Scatter, ScatterBatch, ScatterReads, StorageBackend,
                             byte_view, check_blocks, check_keys, check_outs, check_scatter_outs)

__all__ = ["BackendError", "BackendStats", "Buffer", "Scatter", "ScatterBatch", "ScatterReads", "StorageBackend",
           "byte_view", "check_blocks", "check_keys", "check_outs", "check_scatter_outs"]
