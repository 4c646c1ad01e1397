"""The trainer's checkpoints: DCP and Hugging Face saves, retention, attempts, pre-flight checks."""
