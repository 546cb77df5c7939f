"""lightning-dml: deep metric learning with PyTorch Lightning."""

__version__ = "0.1.0"
