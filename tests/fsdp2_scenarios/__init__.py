"""Shared harnesses of the torch FSDP2 scenario tests (tests/test_fsdp2_training_*.py,
tests/test_fsdp2_state_*.py)."""
