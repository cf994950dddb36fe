"""Register ``"adaptive_elastic"`` with Lightning's strategy registries, so ``Trainer(strategy=...)`` takes the name.

Lightning 2.6 has no plugin discovery for strategies: names must be registered when this package is imported.
``pytorch_lightning`` and the unified ``lightning`` package keep separate registries and separate base classes,
so each gets its own class, built from the same :class:`~lightning_aesgd.strategy.AdaptiveElasticMixin`.
"""

from __future__ import annotations

import importlib.util


def register_all() -> None:
    """Register the strategy names in every installed Lightning namespace; safe to call repeatedly."""
    from pytorch_lightning.strategies import StrategyRegistry

    from lightning_aesgd.strategy import AdaptiveElasticStrategy

    AdaptiveElasticStrategy.register_strategies(StrategyRegistry)
    if importlib.util.find_spec("lightning") is not None:
        from lightning.pytorch.strategies import StrategyRegistry as UnifiedRegistry

        from lightning_aesgd.unified import AdaptiveElasticStrategy as UnifiedStrategy

        UnifiedStrategy.register_strategies(UnifiedRegistry)
