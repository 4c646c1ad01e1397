"""Helpers for the tests and benchmarks: a gloo process launcher, the demo's tiny model,
client loops, collective logs, statistics.

Optional and no part of the library: ``import flexshard`` never loads it and no module
of the library, trainer, planner or demo imports it (pyproject.toml's import contract).
Some of it needs the ``test`` or ``bench`` extras."""

from flexshard.demo.model import TinyTransformer, TransformerConfig, make_batches

from .launch import run_distributed

__all__ = ["TinyTransformer", "TransformerConfig", "make_batches", "run_distributed"]
