"""``python -m lightning_dml`` is the ``lightning-dml`` command (:func:`lightning_dml.entry.main`)."""

from lightning_dml.entry import main

if __name__ == "__main__":
    main()
