"""The placement program, ``python -m lightning_aesgd.bench placement``: where the replicas run, compared honestly.

GPU alone, GPU + CPU replicas (``devices=gpu_cpu``) and the CPU replicas alone (:mod:`.cases`), on XMC
EURLex-shaped and on the Fashion-MNIST CNN (:mod:`.workloads`), each also with the GPU replica emulated several
times slower (a weak GPU, stated as emulation). Every run is a race run (:mod:`lightning_aesgd.bench.race.runner`)
followed by a test of the final model (:mod:`.runner`); :mod:`.benchmark` interleaves the runs, :mod:`.figures`
turns them into ratios to the GPU alone with their spread over repeats, :mod:`.report` writes ``placement.md`` and
``placement.json``, and :mod:`.program` holds the command line. Cases that need a GPU are skipped, with the reason,
where there is none.
"""

from lightning_aesgd.bench.placement.program import main

__all__ = ["main"]
