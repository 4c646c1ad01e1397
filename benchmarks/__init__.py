"""Side-by-side benchmarks of flexshard against torch FSDP2."""
