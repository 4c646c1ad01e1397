"""Train a small transformer on N local gloo ranks with flexshard and show what moves.

    flexshard-demo [--nproc 3] [--steps 30] [--placement mixed|shard0|owned|block|flat]

Every rank builds the same model, shards it into one bucket per layer plus an outer
bucket (embedding, final norm, head), and trains it with AdamW on its own slice of a
synthetic data set. Rank 0 prints one line per step; the parent prints what each
bucket communicated and how far the loss fell.

``cli`` is the command line, ``train`` the ranks' work, ``model`` the tiny transformer
(which the test suite's models share).
"""
