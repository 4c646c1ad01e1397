"""Helpers shared by the tests, benchmarks and demo: a gloo process launcher and small models."""

from .launch import run_distributed
from .models import TinyTransformer, TransformerConfig, make_batches

__all__ = ["TinyTransformer", "TransformerConfig", "make_batches", "run_distributed"]
