"""Process helpers for tests: what a test needs to skip, to start ranks, and to stop what it started.

:func:`missing_modules` (why a test module must skip: ``vllm``, ``ray``... not importable, or a RuntimeError
under ``RL_REQUIRE_VLLM=1``), :func:`run_ranks` (a torch.distributed world of fresh interpreters on this
machine) and :func:`kill_started_with` (stop the processes a test started, by a variable of their
environment). Re-exported by :mod:`rl_rollout.testing`, where tests import them from.
"""

from __future__ import annotations

import importlib
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

from rl_rollout.testing_weights import (  # noqa: F401 - re-exported: tests import them from here
    greedy_reference,
    ipc_sender_process,
    ipc_trainer_process,
    peaked_weights,
)


def missing_modules(*names: str, where: str = "run in .venv-vllm (scripts/vllm-cpu-env.sh)") -> str | None:
    """For the top of a test module: why it must skip (the first of ``names``, e.g. ``"vllm"``, ``"ray"``, that does
    not import, and ``where`` to run it), or None when all import: ``if why := missing_modules("vllm"):
    pytest.skip(why, allow_module_level=True)``. Under ``RL_REQUIRE_VLLM=1`` (CI's vLLM environment, where these
    tests must run) a missing module raises RuntimeError instead."""
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError as e:
            if os.environ.get("RL_REQUIRE_VLLM") == "1":
                raise RuntimeError(
                    f"RL_REQUIRE_VLLM=1 but {name} does not import ({e}); build .venv-vllm with scripts/vllm-cpu-env.sh"
                ) from e
            return f"{name} is not importable here ({e}); {where}"
    return None


def kill_started_with(name: str, value: str) -> int:
    """SIGKILL every process of this machine whose environment has ``name=value`` (e.g. the ``RAY_TMPDIR`` a
    test gave the Ray cluster it started): a test stops its own cluster and nothing else. ``ray stop`` would stop
    every Ray process here, a cluster the user runs included. Returns how many it killed."""
    marker, killed = f"{name}={value}".encode(), 0
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if marker in environ and pid != os.getpid():
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
    return killed


def run_ranks(path: str | os.PathLike, func: str, world: int, *args: str, timeout: float = 600) -> list[str]:
    """Call ``func(rank, port, *args)`` of the Python file ``path`` in ``world`` fresh interpreters, one per rank
    of a torch.distributed world on this machine (``port``: a free one for MASTER_PORT; RANK, LOCAL_RANK,
    WORLD_SIZE and MASTER_PORT are cleared from their environment for ``func`` to set). Each loads the file by
    path: pytest may import a test module under a name that a spawned child could not import. Returns the ranks'
    logs; AssertionError with each log's tail when a rank fails."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    code = (
        "import importlib.util, sys; spec = importlib.util.spec_from_file_location('ranks', sys.argv[1]); "
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
        "getattr(m, sys.argv[2])(int(sys.argv[3]), int(sys.argv[4]), *sys.argv[5:])"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(path), func, str(r), str(port), *args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    logs = [p.communicate(timeout=timeout)[0] for p in procs]
    codes = [p.returncode for p in procs]
    assert codes == [0] * world, f"ranks exited {codes}:\n" + "\n".join(x[-3000:] for x in logs)
    return logs
