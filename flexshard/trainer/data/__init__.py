"""The trainer's data: text sources, batches and samplers (the tokenizer, which the
config reads to size the vocabulary, is ``config.tokenizer``)."""
