"""Episodes from any program: :class:`AgentCmdRunner` plays one episode per dataset row by running an agent
program against an :class:`~rl_rollout.openai_api.OpenAIServer` and returns what the server recorded.

The program (:class:`~rl_rollout.agents.cmd_config.AgentCmdConfig` ``cmd``) is one of:

- a shell command (anything with whitespace, or not of the entry-point forms below), run by ``/bin/sh`` in a
  process group of its own (``start_new_session``) with ``OPENAI_BASE_URL``, ``OPENAI_API_KEY`` (the episode's
  own key) and ``OPENAI_MODEL`` added to the environment; the dataset row (prompt, label and every other key)
  is written to its stdin as one JSON object. Its last non-empty stdout line, when it is a JSON object with
  ``"reward"``, is the episode's reward; otherwise it has none (a reward function may score the transcript).
- a Python entry point ``module:function`` or ``path.py:function`` (no whitespace): called in a thread of its
  own as ``function(row, endpoint)``, ``row`` the same dict, ``endpoint`` an :class:`AgentEndpoint`
  (``base_url``, ``api_key``, ``model``; ``endpoint.env()`` the three variables) so it builds its own
  ``openai.OpenAI(base_url=..., api_key=...)``; it returns ``{"reward": x}`` or None.

Each episode has ``timeout_s``. A shell program that outlives it gets SIGTERM on its whole process group, then
SIGKILL after ``kill_grace_s``; a program that exits has whatever it left running in its group ended the same
way. A Python entry point cannot be killed: its thread is abandoned (daemon). Either way the episode's key is
closed when the episode ends, so a late call (a leftover child, an abandoned thread) gets 410 and is counted
by the server (``gone``), never recorded. Outcomes (:class:`EpisodeResult`): ``ok``, ``failed`` (non-zero exit,
an exception, a malformed or non-finite reward) or ``timeout``; none stops the run.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from rl_rollout.agents.cmd_config import AgentCmdConfig
from rl_rollout.openai_api.episodes import RecordedCall
from rl_rollout.rewards.loading import exec_file

Status = Literal["ok", "failed", "timeout"]
_ENTRY = re.compile(r"^(?P<target>[^\s:]+):(?P<attr>[A-Za-z_][\w.]*)$")


@dataclass(frozen=True)
class AgentEndpoint:
    """What a Python entry point gets beside its row: where to call and with which key."""

    base_url: str
    api_key: str
    model: str

    def env(self) -> dict[str, str]:
        return {"OPENAI_BASE_URL": self.base_url, "OPENAI_API_KEY": self.api_key, "OPENAI_MODEL": self.model}


@dataclass
class EpisodeResult:
    """One episode: ``status``, the program's ``reward`` (None: it gave none), the recorded ``calls``,
    ``error`` (why it failed or timed out; stderr's tail for a program), ``seconds``."""

    status: Status
    reward: float | None
    calls: list[RecordedCall] = field(default_factory=list)
    error: str | None = None
    seconds: float = 0.0


def is_entry_point(cmd: str) -> bool:
    """``module:function`` / ``path.py:function`` (no whitespace), as opposed to a shell command."""
    m = _ENTRY.match(cmd.strip())
    if m is None:
        return False
    target = m["target"]
    return target.endswith(".py") or re.fullmatch(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*", target) is not None


def load_entry_point(cmd: str) -> Callable[..., Any]:
    """The function of ``module:function`` / ``path.py:function``; ValueError naming what is wrong."""
    m = _ENTRY.match(cmd.strip())
    if m is None:
        raise ValueError(f"--agent_cmd {cmd!r} is not module:function or path.py:function")
    target, attr = m["target"], m["attr"]
    if target.endswith(".py"):
        path = Path(target).expanduser()
        if not path.is_file():
            raise ValueError(
                f"--agent_cmd {cmd!r}: file {str(path)!r} does not exist (relative to {os.getcwd()!r}); fix the path"
            )
        try:  # the reward files' and --extension's loader: one stable module name per file, registered
            module = exec_file(path, "rl_agent_cmd")
        except ImportError as e:
            raise ValueError(f"--agent_cmd {cmd!r}: cannot load {str(path)!r} as a Python module ({e})") from e
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as e:
            raise ValueError(f"--agent_cmd {cmd!r}: cannot import module {target!r} ({e})") from e
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"--agent_cmd {cmd!r}: {target} defines no {attr!r}; fix the name after the ':'")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"--agent_cmd {cmd!r}: {attr!r} is a {type(obj).__name__}, not a function(row, endpoint)")
    return obj


def parse_reward(value: Any) -> float | None:
    """``{"reward": x}`` -> x (finite float); None -> None; anything else ValueError."""
    if value is None:
        return None
    if not isinstance(value, dict) or "reward" not in value:
        raise ValueError(f'an agent returns {{"reward": x}} or None, got {value!r:.200}')
    r = value["reward"]
    if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r):
        raise ValueError(f"reward must be a finite number, got {r!r:.100}")
    return float(r)


def last_line_reward(stdout: str) -> float | None:
    """The reward printed on the last non-empty stdout line, or None when that line is not a JSON object with
    ``reward`` (ValueError when it is one with a bad value)."""
    lines = [x for x in stdout.splitlines() if x.strip()]
    if not lines:
        return None
    try:
        obj = json.loads(lines[-1])
    except json.JSONDecodeError:
        return None
    return parse_reward(obj) if isinstance(obj, dict) and "reward" in obj else None


class AgentCmdRunner:
    """Run ``config.cmd`` once per row, ``config.concurrency`` at a time, against ``server`` (started)."""

    def __init__(self, config: AgentCmdConfig, server: Any) -> None:
        self.config = config
        self.server = server
        self.entry = load_entry_point(config.cmd) if is_entry_point(config.cmd) else None

    def run(self, rows: list[dict]) -> list[EpisodeResult]:
        """One :class:`EpisodeResult` per row, in row order."""
        with ThreadPoolExecutor(self.config.concurrency, thread_name_prefix="rl-agent-cmd") as pool:
            return list(pool.map(self.episode, rows))

    def episode(self, row: dict) -> EpisodeResult:
        key, base_url = self.server.open_episode(row.get("id"))
        endpoint = AgentEndpoint(base_url, key, self.server.config.model_name)
        t0 = time.perf_counter()
        try:
            status, reward, error = self._python(row, endpoint) if self.entry else self._shell(row, endpoint)
        finally:
            calls = self.server.close_episode(key)  # a later call with the key: 410
        return EpisodeResult(status, reward, calls, error, time.perf_counter() - t0)

    def _python(self, row: dict, endpoint: AgentEndpoint) -> tuple[Status, float | None, str | None]:
        out: list[Any] = []
        fn = self.entry
        assert fn is not None

        def call() -> None:
            try:
                out.append(("ok", fn(dict(row), endpoint)))
            except BaseException as e:  # noqa: BLE001 - an agent's failure is counted, never stops the run
                out.append(("error", f"{type(e).__name__}: {e}"))

        t = threading.Thread(target=call, name="rl-agent-cmd-entry", daemon=True)
        t.start()
        t.join(self.config.timeout_s)
        if not out:
            return "timeout", None, f"still running after {self.config.timeout_s}s (thread abandoned)"
        kind, value = out[0]
        if kind == "error":
            return "failed", None, value
        try:
            return "ok", parse_reward(value), None
        except ValueError as e:
            return "failed", None, str(e)

    def _shell(self, row: dict, endpoint: AgentEndpoint) -> tuple[Status, float | None, str | None]:
        env = {**os.environ, **endpoint.env()}
        for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):  # not the trainer's rendezvous
            env.pop(k, None)
        proc = subprocess.Popen(
            self.config.cmd,
            shell=True,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            start_new_session=True,  # its own process group: the whole group is ended with the episode
            text=True,
        )
        data = json.dumps(row, default=str) + "\n"
        try:
            stdout, stderr = proc.communicate(data, timeout=self.config.timeout_s)
        except subprocess.TimeoutExpired:
            self._end_group(proc)
            stdout, stderr = proc.communicate()
            return "timeout", None, f"killed after {self.config.timeout_s}s; stderr: {_tail(stderr)}"
        finally:
            self._end_group(proc)
        if proc.returncode != 0:
            return "failed", None, f"exit status {proc.returncode}; stderr: {_tail(stderr)}"
        try:
            return "ok", last_line_reward(stdout), None
        except ValueError as e:
            return "failed", None, str(e)

    def _end_group(self, proc: subprocess.Popen) -> None:
        """SIGTERM to the program's group, SIGKILL to what is left after ``kill_grace_s``; quick when it is
        empty. The leader is reaped meanwhile (a zombie still counts as a member)."""
        pgid = proc.pid
        if not _signal_group(pgid, signal.SIGTERM):
            return
        deadline = time.monotonic() + self.config.kill_grace_s
        while time.monotonic() < deadline:
            proc.poll()
            if not _signal_group(pgid, 0):
                return
            time.sleep(0.02)
        _signal_group(pgid, signal.SIGKILL)


def _signal_group(pgid: int, sig: int) -> bool:
    """Send ``sig`` to the group; False when it has no process left."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    except PermissionError:  # a member we may not signal (it changed user): nothing more we can do
        return False
    return True


def _tail(text: str | None, n: int = 400) -> str:
    text = (text or "").strip()
    return text[-n:] if text else "(empty)"
