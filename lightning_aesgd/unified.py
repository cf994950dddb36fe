"""The strategy for the unified ``lightning`` package (``lightning.pytorch.Trainer``).

Example:
    >>> import lightning.pytorch as L
    >>> from lightning_aesgd.unified import AdaptiveElasticStrategy
    >>> strategy = AdaptiveElasticStrategy(sync="models", period=4)
    >>> trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, logger=False)
"""

from __future__ import annotations

from lightning.pytorch.strategies import DDPStrategy

from lightning_aesgd.strategy import AdaptiveElasticMixin


# mypy sees the mixin's pytorch_lightning base next to lightning.pytorch's: same code, distinct classes.
class AdaptiveElasticStrategy(AdaptiveElasticMixin, DDPStrategy):  # type: ignore[misc]
    """Adaptive elastic training as a ``lightning.pytorch`` strategy. See :class:`AdaptiveElasticMixin`."""
