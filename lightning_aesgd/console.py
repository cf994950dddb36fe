"""The main job's console: one line per fact, from rank zero.

Lightning and torch repeat some harmless messages in every replica process, or once per Trainer; the main job
(:mod:`lightning_aesgd.train`) calls :func:`quiet_known_noise` so that its console shows each fact once. Only the
messages named here are touched, only by the project's own entry points; every other warning and log line
passes as it would. Importing this module changes nothing.
"""

from __future__ import annotations

import logging
import warnings

KNOWN_WARNINGS: tuple[tuple[str, type[Warning]], ...] = (
    # torch ≥ 2.10 deprecates `LeafSpec`, which Lightning 2.6 still builds: once per replica process and per
    # Trainer, nothing a user can act on.
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning),
    # configs/hydra/launcher/submitit_{local,slurm}.yaml keep the names users know, which are also the names of the
    # launcher plugin's own schemas: Hydra then checks the files against them, as intended, and warns that it will
    # stop (the files are complete without them).
    (r"\s*'hydra/launcher/submitit_(local|slurm)' is validated against ConfigStore schema", UserWarning),
)
"""Warnings (message pattern, category) that :func:`quiet_known_noise` hides."""

_DROPPED_PREFIXES = (
    # Lightning's advertisements for packages of its own (once per Trainer, and per rank under fork).
    "💡 Tip:",
    # Printed by every rank; the registration line below says the same once.
    "Initializing distributed:",
)
_ONCE_PREFIXES = ("GPU available:", "TPU available:", "HPU available:")
"""Lines that repeat for every Trainer a job builds (the test Trainer too): shown the first time only."""
_REGISTERED = "All distributed processes registered."
_LOGGERS = (
    "lightning_utilities.core.rank_zero",
    "lightning_fabric.utilities.rank_zero",
    "lightning_fabric.utilities.distributed",
    "pytorch_lightning.utilities.rank_zero",
    "lightning.fabric.utilities.rank_zero",
    "lightning.fabric.utilities.distributed",
    "lightning.pytorch.utilities.rank_zero",
)
"""The loggers that emit the lines above, in both Lightning namespaces."""


class KnownNoiseFilter(logging.Filter):
    """Drops Lightning's known repeated lines and folds its four-line process-group banner into one line."""

    def __init__(self) -> None:
        super().__init__()
        self._seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        """Whether to emit ``record``; the banner is rewritten in place."""
        message = record.getMessage()
        if message.startswith(_DROPPED_PREFIXES):
            return False
        if message.startswith(_ONCE_PREFIXES):
            if message in self._seen:
                return False
            self._seen.add(message)
        elif _REGISTERED in message:
            # "----\ndistributed_backend=gloo\nAll distributed processes registered. Starting with 4 processes\n----"
            facts = [line.strip() for line in message.splitlines() if line.strip() and set(line.strip()) != {"-"}]
            record.msg, record.args = "; ".join(reversed(facts)), None
        return True


_FILTER = KnownNoiseFilter()


def quiet_known_noise() -> None:
    """Hide :data:`KNOWN_WARNINGS` and Lightning's repeated lines in this process and the replicas it forks.

    Idempotent. Replicas started by re-running the entry point (Lightning's script launcher) call it themselves.
    """
    for pattern, category in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern, category=category)
    for name in _LOGGERS:
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)
