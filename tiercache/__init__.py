"""tiercache: a tiered KV-cache offload service (GPU, shared-memory host and LMDB disk tiers)."""

__version__ = "0.2.0"
