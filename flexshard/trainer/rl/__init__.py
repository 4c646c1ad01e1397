"""On-policy GRPO in the trainer (``[rl]``): the verifiable task, the generator (the
model's own forward with its KV cache), the update, and the batch-invariant mode."""
