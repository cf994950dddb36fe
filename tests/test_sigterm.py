from types import SimpleNamespace

import pytest
from pytorch_lightning.loops.training_epoch_loop import SIGTERMException

from lightning_aesgd.sigterm import replace_stop_broadcast


class _EpochLoop:
    def __init__(self):
        self.broadcasts = 0

    def _broadcast_sigterm_tensor(self):
        self.broadcasts += 1


def test_the_per_step_sigterm_broadcast_is_answered_from_the_reports_without_a_collective():
    loop = _EpochLoop()
    outcome = SimpleNamespace(stop_requested=False)
    check = replace_stop_broadcast(SimpleNamespace(fit_loop=SimpleNamespace(epoch_loop=loop)), outcome)
    loop._broadcast_sigterm_tensor()  # a step between merges too: no collective, however fast or slow the peers
    assert loop.broadcasts == 0
    outcome.stop_requested = True  # a replica reported SIGTERM at the latest merge
    with pytest.raises(SIGTERMException):
        loop._broadcast_sigterm_tensor()
    check.restore()
    loop._broadcast_sigterm_tensor()
    assert loop.broadcasts == 1
