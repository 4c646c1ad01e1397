"""Sharded parameters as DTensors: flexshard's own placement (``RegionShard``), the
DTensor subclass that carries it, its chunks for torch.distributed.checkpoint,
tensor-parallel parameters, ``distribute_tensor`` and each parameter's spec."""
