"""Shared harnesses of the torch FSDP2 scenario tests (tests/fsdp2/test_fsdp2_training_*.py,
tests/fsdp2/test_fsdp2_state_*.py)."""
