"""lightning_aesgd: adaptive elastic model-averaging SGD for heterogeneous hardware, as a Lightning strategy.

Importing the package registers the strategy names, so an existing Trainer gains the algorithm with one
argument::

    import lightning_aesgd  # registers "adaptive_elastic"
    trainer = Trainer(accelerator="gpu", devices=4, strategy="adaptive_elastic")
"""

import logging

from lightning_aesgd.callbacks import SlowdownCallback
from lightning_aesgd.core.lr import InverseTimeDecay
from lightning_aesgd.core.merge import EASGD, SMA, CentralElastic, ElasticAverage, MergeRule
from lightning_aesgd.core.slowdown import SlowdownChange, SlowdownProfile
from lightning_aesgd.engine.comm import ReplicaStalledError
from lightning_aesgd.registration import register_all
from lightning_aesgd.strategy import AdaptiveElasticStrategy

__version__ = "0.1.0"

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

# Like Lightning's own loggers: the end-of-fit summary shows without any logging configuration.
_log = logging.getLogger(__name__)
if not _log.handlers:
    _log.addHandler(logging.StreamHandler())
    _log.setLevel(logging.INFO)
    _log.propagate = False
