"""Every test starts with this process's torch.distributed rendezvous variables as the session began.

In-process runs (``main(["ppo", ...])``) set ``RANK``, ``MASTER_PORT``... for their one-rank group and
leave them set; a later test's subprocess would inherit a port this process still holds (EADDRINUSE) or
a rank that is not its own."""

from __future__ import annotations

import os

import pytest

DIST_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def _restore_rendezvous_env():
    before = {k: os.environ.get(k) for k in DIST_KEYS}
    yield
    for k, v in before.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
