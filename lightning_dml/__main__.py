"""``python -m lightning_dml`` is the ``lightning-dml`` command."""

from lightning_dml.cli import main

if __name__ == "__main__":
    main()
