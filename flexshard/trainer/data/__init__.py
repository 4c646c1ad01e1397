"""The trainer's data: text sources, batches, samplers and tokenizers."""
