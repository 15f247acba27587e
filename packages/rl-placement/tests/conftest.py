"""Environment for the Ray tests of rl-placement: fast, and the same venv for every worker."""

import os
import tempfile

import pytest

# Under `uv run`, Ray 2.45+ would rebuild the whole workspace into every worker's
# environment (its uv hook, ~40 s here); the workers already share this venv.
_RAY_ENV = {
    "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
    # The venv has no .pyc files and these machines set PYTHONDONTWRITEBYTECODE, so every
    # Ray worker would compile Ray from source (~1.5 s of CPU each). Let the workers keep
    # bytecode in a temp prefix (the run's own when one is set: .ci/run sets one); nothing is written into the venv.
    "PYTHONPYCACHEPREFIX": os.environ.get("PYTHONPYCACHEPREFIX") or os.path.join(tempfile.gettempdir(),
                                                                                 "rl-placement-pycache"),
    # Ray kills workers when the node passes 95% memory, counting everyone's processes; on a
    # shared CI machine that turns another job's peak into a failure here. Our actors are tiny.
    "RAY_memory_monitor_refresh_ms": "0",
}


@pytest.fixture(scope="module")
def ray_worker_env():
    """Set the environment that Ray's processes inherit; restored when the module ends."""
    import ray._private.ray_constants as ray_constants

    saved = {k: os.environ.get(k) for k in (*_RAY_ENV, "PYTHONDONTWRITEBYTECODE")}
    saved_flag = ray_constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV
    os.environ.update(_RAY_ENV)
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    ray_constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV = False  # read at import: ray may be imported already
    yield
    ray_constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV = saved_flag
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
