"""Helpers the tests share: hypothesis strategies, reference models, harnesses."""
