"""``python -m kaisoku``: the same as the ``kaisoku`` command (torchrun starts ranks this way)."""

from kaisoku.cli import main

if __name__ == "__main__":
    main()
