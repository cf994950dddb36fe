"""The overhead program, ``python -m lightning_aesgd.bench overhead``: what the strategy's machinery costs.

One model merge is timed against one plain all-reduce of the same bytes on two gloo processes (:mod:`.merge`),
and the planning work per merge and the planned sampler's per batch are timed without any communication, beside
torch's ``DistributedSampler`` (:mod:`.local`); :mod:`.report` draws the markdown tables and :mod:`.program`
holds the command line, which writes every figure to ``overhead.json``.
"""

from lightning_aesgd.bench.overhead.program import main

__all__ = ["main"]
