"""``torchrun --nproc-per-node N -m flexshard.trainer --config configs/debug.toml``"""

from .launch import main

main()
