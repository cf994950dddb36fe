"""lightning_aesgd: adaptive elastic training for heterogeneous hardware, as a PyTorch Lightning strategy.

Importing the package registers the strategy names, so an existing Trainer gains the algorithm with one
argument::

    import lightning_aesgd  # registers "adaptive_elastic"
    trainer = Trainer(accelerator="gpu", devices=4, strategy="adaptive_elastic")
"""

import logging
from importlib.metadata import PackageNotFoundError, version

from lightning_aesgd.callbacks import SlowdownCallback
from lightning_aesgd.core.lr import InverseTimeDecay
from lightning_aesgd.core.merge import EASGD, SMA, CentralElastic, ElasticAverage, MergeRule
from lightning_aesgd.emulation.profiles import SlowdownChange, SlowdownProfile
from lightning_aesgd.engine.comm import ReplicaStalledError
from lightning_aesgd.registration import register_all
from lightning_aesgd.strategy import AdaptiveElasticStrategy

try:
    __version__ = version("lightning-aesgd")  # the one place it is written: pyproject.toml
except PackageNotFoundError:  # a source checkout on PYTHONPATH, never installed
    __version__ = "0+unknown"

__all__ = [
    "EASGD",
    "SMA",
    "AdaptiveElasticStrategy",
    "CentralElastic",
    "ElasticAverage",
    "InverseTimeDecay",
    "MergeRule",
    "ReplicaStalledError",
    "SlowdownCallback",
    "SlowdownChange",
    "SlowdownProfile",
    "register_all",
]

register_all()


class _FallbackHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Prints to stderr only while the root logger has no handler of its own.

    The end-of-fit summary then shows without any logging configuration, and where the application configured
    logging (Hydra's console and ``train.log``, a user's handlers) it propagates there instead, printed once.
    """

    def handle(self, record: logging.LogRecord) -> bool:
        if logging.getLogger().handlers:
            return False
        return bool(super().handle(record))


_log = logging.getLogger(__name__)
# By name: a second import of the package (a reload, a test importing it afresh) must not add a second copy.
if not any(type(handler).__name__ == _FallbackHandler.__name__ for handler in _log.handlers):
    _log.addHandler(_FallbackHandler())
    if _log.level == logging.NOTSET:
        _log.setLevel(logging.INFO)
