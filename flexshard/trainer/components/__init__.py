"""The training loop's own pieces: the optimizer, the learning-rate schedule and the
metrics (the data, checkpointing and rl components have folders of their own)."""
