"""Storage tiers: gpu (device pool), host (shared-memory slab), disk (LMDB), behind tiers.base.Tier."""
