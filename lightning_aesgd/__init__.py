"""lightning_aesgd: adaptive elastic model-averaging SGD for heterogeneous hardware, as a Lightning strategy."""

__version__ = "0.1.0"
