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


class _Launcher:
    def __init__(self):
        self.killed = []

    def kill(self, signum):
        self.killed.append(signum)


def test_sigterm_is_recorded_for_the_reports_and_passed_on_without_a_collective():
    # Lightning's own handler broadcasts from inside the handler, to meet a per-step broadcast that no longer runs.
    launcher = _Launcher()
    signals = SimpleNamespace(trainer=SimpleNamespace(strategy=SimpleNamespace(launcher=launcher)))
    trainer = SimpleNamespace(fit_loop=SimpleNamespace(epoch_loop=_EpochLoop()), _signal_connector=signals)
    check = replace_stop_broadcast(trainer, SimpleNamespace(stop_requested=False))
    assert signals._sigterm_notifier_fn == check.note_sigterm  # what the Trainer registers after the setup
    signals._sigterm_notifier_fn(15, None)
    signals._sigterm_notifier_fn(15, None)
    assert check.received
    assert launcher.killed == [15], "passed on to the launched processes once, as Lightning does"
    check.restore()
    assert "_sigterm_notifier_fn" not in vars(signals)
