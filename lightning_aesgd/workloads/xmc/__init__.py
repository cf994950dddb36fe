"""Sparse extreme multi-label classification (XMC): generator, statistics, batches, DataModule, model, metrics."""
