"""An LLM trainer on flexshard: Llama-style model (dense or MoE), byte-level data,
TOML config, data parallelism through flexshard or torch FSDP2, metrics, checkpoints.

    flexshard-train --nproc 3 --config configs/debug.toml --training.steps 20

The package imports nothing itself, so its command lines (``launch``, ``generate``)
print ``--help`` without importing torch; ``flexshard.trainer.train.run`` runs a job.
"""
