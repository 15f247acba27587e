"""Agent files for the RL loop (``--agent_func_path``): OpenRLHF's ``AgentInstance`` form, or our :class:`Environment`.

:func:`load_agent` reads ``file.py`` (or ``file.py:NAME``, or ``builtin:calculator``) and returns a
factory of fresh :class:`~rl_rollout.agents.env.Environment` objects, one per episode, for
:class:`~rl_rollout.agents.executor.AgentExecutor`. What the file may hold:

- OpenRLHF's form (``--train.agent_func_path`` files): a class ``AgentInstance`` built without
  arguments, with ``async reset(states)`` (``states = {"observation": prompt text, "label": label}``,
  returns ``{"observation": text}``) and ``async step(states)`` (``states = {"observation_text",
  "action_text", "label", "sampling_params"}``) returning a dict with ``rewards`` (a number or a
  one-element tensor), ``scores`` (optional, for dynamic filtering), ``environment_feedback`` (text
  appended after the action), ``done``, optional ``sampling_params`` and ``extra_logs``.
  :class:`OpenRLHFAgentEnv` adapts it. Such a file imports its base class with
  ``from openrlhf.utils.agent import AgentInstanceBase``; where OpenRLHF is not installed that import
  is served by this module (the only name it needs); the one-line change that makes the file ours is
  ``from rl_rollout.agents.openrlhf import AgentInstanceBase``.
- Our protocol: ``NAME`` (default ``make_env``) is a class or function that returns an object with
  ``async reset(prompt, label, **info) -> str | None`` and ``async step(action_text) -> StepResult``.

Differences from OpenRLHF, on purpose: token in / token out (the executor never re-tokenizes the
policy's tokens; OpenRLHF concatenates texts only for ``observation_text``, as here); the observation
``reset`` returns must be the prompt, or the prompt followed by more text (appended, loss mask 0):
the prompt's tokens are the dataset's; a ``sampling_params`` returned by ``step`` is not applied
(every turn samples with the run's parameters, so the trainer's log-probs keep matching the engine's).
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rl_rollout.agents.calculator import CalculatorEnv
from rl_rollout.agents.env import Environment, StepResult

__all__ = ["AgentExecutorBase", "AgentInstanceBase", "OpenRLHFAgentEnv", "load_agent"]


class AgentInstanceBase:
    """OpenRLHF's ``openrlhf.utils.agent.AgentInstanceBase``, for agent files written for it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    async def reset(self, states: dict, **kwargs: Any) -> dict:
        return states

    async def step(self, states: dict, **kwargs: Any) -> dict:
        raise NotImplementedError("AgentInstance.step is not implemented")


class AgentExecutorBase:
    """OpenRLHF's executor base, so files that subclass it import; the loop runs its own executor."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass


def _number(value: Any, what: str) -> float:
    item = getattr(value, "item", None)  # a one-element tensor or numpy value
    try:
        return float(item() if callable(item) else value)
    except (TypeError, ValueError):
        raise TypeError(
            f"AgentInstance.step returned {what}={value!r}; give a number or a one-element tensor"
        ) from None


class OpenRLHFAgentEnv:
    """An OpenRLHF ``AgentInstance`` as an :class:`Environment` (one instance per episode).

    ``step`` info carries ``score`` (OpenRLHF's ``scores``, else the reward) and ``extra_logs`` (numbers).
    """

    def __init__(self, instance: Any):
        self.instance = instance
        self.label: Any = None
        self.observation_text = ""

    async def reset(self, prompt: str | None, label: Any, **info: Any) -> str | None:
        self.label = label
        out = await self.instance.reset({"observation": prompt, "label": label})
        text = out.get("observation", prompt) if isinstance(out, dict) else prompt
        prompt = prompt or ""
        if text is None or text == prompt:
            self.observation_text = prompt
            return None
        if not text.startswith(prompt):
            raise ValueError(
                f"{type(self.instance).__name__}.reset returned an observation that does not start with "
                f"the prompt ({text[:60]!r} for {prompt[:60]!r}); return the prompt, optionally followed "
                "by more text: the prompt's tokens come from the dataset"
            )
        self.observation_text = text
        return text[len(prompt) :]

    async def step(self, action_text: str) -> StepResult:
        states = {
            "observation_text": self.observation_text,
            "action_text": action_text,
            "label": self.label,
            "sampling_params": None,
        }
        out = await self.instance.step(states)
        if not isinstance(out, dict):
            raise TypeError(
                f"{type(self.instance).__name__}.step returned {type(out).__name__}; return a dict with "
                "rewards, environment_feedback and done (OpenRLHF's form)"
            )
        missing = [k for k in ("rewards", "environment_feedback", "done") if k not in out]
        if missing:
            raise KeyError(
                f"{type(self.instance).__name__}.step returned no {', '.join(missing)} (keys: "
                f"{', '.join(out)}); OpenRLHF's form needs rewards, environment_feedback and done"
            )
        reward = _number(out["rewards"], "rewards")
        score = _number(out["scores"], "scores") if out.get("scores") is not None else reward
        extra = {k: _number(v, f"extra_logs[{k!r}]") for k, v in (out.get("extra_logs") or {}).items()}
        feedback = str(out["environment_feedback"] or "")
        self.observation_text += action_text + feedback
        return StepResult(feedback, reward=reward, done=bool(out["done"]), info={"score": score, "extra_logs": extra})


@contextlib.contextmanager
def _openrlhf_import_shim():
    """``openrlhf.utils.agent`` served from here while a file is loaded, when OpenRLHF is not installed."""
    if importlib.util.find_spec("openrlhf") is not None:
        yield
        return
    names = ("openrlhf", "openrlhf.utils", "openrlhf.utils.agent")
    saved = {n: sys.modules.get(n) for n in names}
    mods = {n: types.ModuleType(n) for n in names}
    mods["openrlhf"].utils = mods["openrlhf.utils"]
    mods["openrlhf.utils"].agent = mods["openrlhf.utils.agent"]
    mods["openrlhf.utils.agent"].AgentInstanceBase = AgentInstanceBase
    mods["openrlhf.utils.agent"].AgentExecutorBase = AgentExecutorBase
    sys.modules.update(mods)
    try:
        yield
    finally:
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m


def _load_file(path: str) -> types.ModuleType:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"--agent_func_path {path}: no such file")
    name = f"rl_agent_{abs(hash(str(p.resolve())))}"
    spec = importlib.util.spec_from_file_location(name, p)
    if spec is None or spec.loader is None:  # e.g. a file name Python has no loader for
        raise ImportError(f"--agent_func_path {path}: cannot load it as a Python module")
    module = importlib.util.module_from_spec(spec)
    with _openrlhf_import_shim():
        spec.loader.exec_module(module)
    return module


def load_agent(spec: str) -> Callable[[], Environment]:
    """``file.py``, ``file.py:NAME`` or ``builtin:calculator`` -> a factory of fresh environments."""
    if spec == "builtin:calculator":
        return CalculatorEnv
    path, _, name = spec.partition(":") if not spec.endswith(".py") else (spec, "", "")
    module = _load_file(path)
    names = [name] if name else ["AgentInstance", "make_env"]
    found = next((n for n in names if hasattr(module, n)), None)
    if found is None:
        raise AttributeError(
            f"--agent_func_path {spec}: the file defines none of {', '.join(names)}: define "
            "AgentInstance (OpenRLHF's form) or make_env (returning an Environment), or name it "
            "with file.py:NAME"
        )
    obj = getattr(module, found)
    openrlhf_form = found == "AgentInstance" or (
        inspect.isclass(obj) and any(c.__name__ == "AgentInstanceBase" for c in obj.__mro__[1:])
    )
    if openrlhf_form:
        return lambda: OpenRLHFAgentEnv(obj())
    if not callable(obj):
        raise TypeError(
            f"--agent_func_path {spec}: {found} is a {type(obj).__name__}; give a class or function "
            "that returns an Environment"
        )
    return obj
