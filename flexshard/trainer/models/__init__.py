"""The trainer's models: the Llama-style Transformer (dense or MoE) and its Hugging Face twin."""
