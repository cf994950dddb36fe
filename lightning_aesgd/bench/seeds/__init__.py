"""The seed papers' claims, ``python -m lightning_aesgd.bench seeds``: each a small race, a statement and a verdict.

:mod:`.claims` lists the claims (entrants, workload, devices, target, the paper's statement), :mod:`.verdicts`
holds the pure rules that judge them, and :mod:`.program` runs each claim with the race's machinery
(:mod:`lightning_aesgd.bench.race`) and writes the table "claim | paper says | rival | spread | we measured |
verdict".
"""

from lightning_aesgd.bench.seeds.program import main

__all__ = ["main"]
