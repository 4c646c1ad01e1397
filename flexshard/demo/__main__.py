"""``python -m flexshard.demo``: the ``flexshard-demo`` command."""

from .cli import main

if __name__ == "__main__":
    main()
