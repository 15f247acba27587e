"""Which Ray cluster ``rl ppo-ray`` runs on, found the way OpenRLHF users start one.

- ``--ray_address`` or ``RAY_ADDRESS`` (``ray job submit`` sets it for the job's driver): that cluster.
- ``--num_gpus N``: a fresh local Ray with N logical GPUs, never a cluster already running.
- Neither: the cluster that ``ray start --head`` (with ``ray start --address`` workers on other
  nodes) runs on this machine, as Ray records it in ``ray_current_cluster`` under ``RAY_TMPDIR``
  (default ``/tmp/ray``), when its GCS answers; otherwise a fresh local Ray.

Token authentication (Ray 2.52+): ``ray start --head`` turns it on when a token exists
(``~/.ray/auth_token``), and Ray's driver then connects only with ``RAY_AUTH_MODE=token``
unless Ray found the cluster itself. Here, connecting to an existing cluster with
``RAY_AUTH_MODE`` unset and a token at hand (``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH`` or
``~/.ray/auth_token``) turns token mode on for this process and its children; a cluster without
authentication accepts such a driver too. A refused connection stops with one line that names
``RAY_AUTH_MODE=token`` and where the token goes, at once (one GCS request) rather than after
``ray.init``'s 20 s of retries.

Leaves out: Ray Client (``ray://`` addresses go to ``ray.init`` unchanged) and copying the
token between nodes (a second node needs the head's token in its own ``~/.ray/auth_token``).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

TOKEN_HINT = (
    "run with RAY_AUTH_MODE=token and the cluster's token in ~/.ray/auth_token (or RAY_AUTH_TOKEN / "
    "RAY_AUTH_TOKEN_PATH); on the head node `ray get-auth-token` prints it"
)


def token_available() -> bool:
    if os.environ.get("RAY_AUTH_TOKEN"):
        return True
    path = os.environ.get("RAY_AUTH_TOKEN_PATH")
    return Path(path).is_file() if path else (Path.home() / ".ray" / "auth_token").is_file()


def _current_cluster_file() -> Path:
    try:
        from ray._common.utils import get_ray_address_file

        return Path(get_ray_address_file(None))
    except ImportError:  # Ray moved it: the same rule, RAY_TMPDIR, else TMPDIR, else /tmp
        return Path(os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or "/tmp") / "ray" / "ray_current_cluster"


def _answers(address: str, timeout_s: float = 2.0) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


def started_cluster() -> str | None:
    """The address of the cluster ``ray start --head`` runs on this machine, if its GCS answers."""
    f = _current_cluster_file()
    address = f.read_text().strip() if f.is_file() else ""
    return address if address and _answers(address) else None


def cluster_address(ray_address: str | None, num_gpus: int | None) -> str | None:
    """The cluster to join, or None for a fresh local Ray (see the module docstring for the order)."""
    explicit = ray_address or os.environ.get("RAY_ADDRESS")
    if explicit:
        return explicit
    return None if num_gpus is not None else started_cluster()


def connect(address: str, prog: str = "rl ppo-ray") -> None:
    """``ray.init`` on an existing cluster, token authentication included; one line when refused."""
    import ray

    if os.environ.get("RAY_AUTH_MODE") is None and token_available():
        os.environ["RAY_AUTH_MODE"] = "token"
        try:  # Ray caches its config at import: have it read the mode again (what `ray start` does itself)
            from ray._private.authentication.authentication_token_setup import _enable_token_auth

            _enable_token_auth()
        except ImportError:
            pass
    try:
        _refused_at_once(address)
        ray.init(address=address, include_dashboard=False)
    except (ConnectionError, ray.exceptions.AuthenticationError, RuntimeError) as e:
        mode = os.environ.get("RAY_AUTH_MODE")
        why = (
            f"RAY_AUTH_MODE is {mode or 'unset'}, and no token was found"
            if mode != "token" or not token_available()
            else "the token here is not the cluster's"
        )
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise SystemExit(
            f"{prog}: cannot join the Ray cluster at {address} ({type(e).__name__}: {first}). If it "
            f"uses token authentication (Ray 2.52+ `ray start --head` turns it on when a token exists; "
            f"{why}): {TOKEN_HINT}"
        ) from None


def _refused_at_once(address: str) -> None:
    """Raise Ray's AuthenticationError when a GCS that answers refuses this process's token (or its lack).

    ``ray.init`` retries a refused connection once a second for ~20 s (RAY_NUM_REDIS_GET_RETRIES) before
    giving up; one GCS client asks once. Anything else (a GCS that does not answer, a Ray without this
    client) is left to ``ray.init``, as before."""
    import ray

    if "://" in address or not _answers(address):
        return
    try:
        from ray._raylet import GcsClient  # type: ignore[attr-defined]  # Cython class; ray's _raylet.pyi omits it
    except ImportError:
        return
    try:
        GcsClient(address=address)
    except ray.exceptions.AuthenticationError:
        raise
    except Exception:  # noqa: BLE001 - not ours to judge: ray.init decides and says
        return
