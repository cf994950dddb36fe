"""The per-replica machinery, free of Lightning: merges, plans, the batch sampler, timing, communication.

The engine composes the pure rules of :mod:`lightning_aesgd.core` with torch and ``torch.distributed``; the
Lightning glue (:mod:`lightning_aesgd.strategy`) only calls it from Lightning's hooks. Nothing here imports
Lightning (a test checks), so the engine runs under a fake communicator in tests and under any loop.
"""
