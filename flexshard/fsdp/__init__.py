"""The FSDP2 surface: fully_shard / flex_shard and their bucket plans, state dicts,
clipping, meta init."""
