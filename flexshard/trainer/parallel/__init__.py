"""The trainer's parallelisms: the mesh, TP, PP, CP, EP, activation checkpointing and DP
(sharding), composed in parallelize."""
