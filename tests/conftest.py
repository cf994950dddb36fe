import os

import pytest
import torch


@pytest.fixture(autouse=True)
def _teardown_process_group():
    """Destroy any process group a test left behind, so the next test starts clean."""
    yield
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


@pytest.fixture(autouse=True)
def _restore_env_variables():
    """Lightning's launchers export rank variables; keep them from leaking into later tests."""
    env_backup = os.environ.copy()
    yield
    os.environ.clear()
    os.environ.update(env_backup)
