"""Pure math of adaptive elastic training: merge rules, weights, schedules, speed estimation and planning.

Modules here import torch (and numpy) but never Lightning or ``torch.distributed``, so they can be tested
and reused on their own.
"""
