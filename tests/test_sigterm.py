from types import SimpleNamespace

import pytest
from pytorch_lightning.loops.training_epoch_loop import SIGTERMException

from lightning_aesgd.sigterm import replace_stop_broadcast


class _EpochLoop:
    def __init__(self):
        self.broadcasts = 0

    def _broadcast_sigterm_tensor(self):
        self.broadcasts += 1


def test_the_per_step_sigterm_broadcast_is_answered_from_the_merge_that_just_ran():
    loop = _EpochLoop()
    outcome = SimpleNamespace(synced_last_step=False, stop_requested=False, waited_last_step=False)
    check = replace_stop_broadcast(SimpleNamespace(fit_loop=SimpleNamespace(epoch_loop=loop)), outcome)
    loop._broadcast_sigterm_tensor()  # after a step without a merge: Lightning's own broadcast
    assert loop.broadcasts == 1
    outcome.synced_last_step = True
    loop._broadcast_sigterm_tensor()  # after a merge: no collective
    assert loop.broadcasts == 1
    outcome.synced_last_step, outcome.waited_last_step = False, True
    loop._broadcast_sigterm_tensor()  # a merge that waited on every rank (one replica trains alone): none either
    assert loop.broadcasts == 1
    outcome.synced_last_step, outcome.waited_last_step = True, False
    outcome.stop_requested = True  # a replica reported SIGTERM in that merge
    with pytest.raises(SIGTERMException):
        loop._broadcast_sigterm_tensor()
    check.restore()
    loop._broadcast_sigterm_tensor()
    assert loop.broadcasts == 2
