"""Turn a reward spec (a callable or a string) into a reward function.

A reward function scores one response::

    fn(prompt: str, response: str, label: str | None, **info) -> float

``prompt`` and ``response`` are decoded text, ``label`` is the dataset's
reference answer (None when the dataset has no ``label_key``), and ``info``
holds extra per-sample fields the caller passes (e.g. ``finish_reason``); a
function must accept ``**info`` even when it ignores it, so new fields never
break old functions. The return value must be a real number (bool, int and 0-d
tensors are taken as float; NaN is an error).

Spec strings, all resolved by :func:`load_reward_fn`:

- ``"path/to/file.py:func"``: a file, executed as a fresh module (a path
  relative to the working directory); the part before the last ``:`` ends in
  ``.py``.
- ``"package.module:func"``: an importable module; ``func`` may be dotted
  (``"mod:Class.method"``).
- ``"builtin:NAME[:ARG]"``: a verifier of :mod:`rl_rollout.rewards.verifiers`
  (``exact_match``, ``exact_match:strict``, ``math``, ``math:REL_TOL``,
  ``format:REGEX``).

Only loading lives here; running functions safely (timeouts, fallbacks) is
:mod:`rl_rollout.rewards.runner`.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import math
import numbers
import os
import sys
from pathlib import Path
from typing import Any, Protocol, Union

SPEC_FORMS = "'path/to/file.py:func', 'package.module:func' or 'builtin:NAME' (exact_match, math, format:REGEX)"


class RewardFn(Protocol):
    def __call__(self, prompt: str, response: str, label: str | None, **info: Any) -> float: ...


RewardSpec = Union[str, RewardFn]


class RewardLoadError(ValueError):
    """A reward spec that cannot be turned into a reward function; the message names the spec and the fix."""


def load_reward_fn(spec: RewardSpec) -> RewardFn:
    """Resolve ``spec`` (a callable or a spec string, see the module docstring) to a checked reward function."""
    if callable(spec):
        fn, where = spec, reward_fn_name(spec)
    elif isinstance(spec, str):
        fn, where = _load_string(spec), repr(spec)
    else:
        raise RewardLoadError(
            f"reward spec must be a callable or a string ({SPEC_FORMS}), got {type(spec).__name__} {spec!r}"
        )
    _check_signature(fn, where)
    return fn


def reward_fn_name(spec: RewardSpec) -> str:
    """A short name for logs and errors: the spec string itself, or ``module.qualname`` of a callable."""
    if isinstance(spec, str):
        return spec
    qualname = getattr(spec, "__qualname__", None)
    if qualname is not None:
        return f"{getattr(spec, '__module__', '?')}.{qualname}"
    text = repr(spec)
    return text if len(text) <= 80 else text[:77] + "..."


def as_reward(value: Any, name: str) -> float:
    """``value`` as a float reward, or a TypeError/ValueError that names the function and what it returned."""
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):  # a 0-d torch or numpy scalar
        value = value.item()
    if not isinstance(value, numbers.Real):
        raise TypeError(f"reward function {name} returned {type(value).__name__} {value!r:.80}; it must return a float")
    reward = float(value)
    if math.isnan(reward):
        raise ValueError(f"reward function {name} returned NaN; return a finite float")
    return reward


def _load_string(spec: str) -> RewardFn:
    if spec.startswith("builtin:"):
        from rl_rollout.rewards.verifiers import make_builtin

        return make_builtin(spec.removeprefix("builtin:"))
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise RewardLoadError(f"reward spec {spec!r} has no ':'; write it as {SPEC_FORMS}")
    if target.endswith(".py"):
        module, where = _exec_file(spec, target), target
    else:
        module, where = _import_module(spec, target), f"module {target}"
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            defined = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
            raise RewardLoadError(
                f"reward spec {spec!r}: {where} defines no {attr!r}; callables defined there: {defined}. "
                "Fix the name after the ':'"
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise RewardLoadError(
            f"reward spec {spec!r}: {attr!r} in {where} is a {type(obj).__name__}, not a callable; point the spec "
            "at a function fn(prompt, response, label, **info) -> float"
        )
    return obj


def _exec_file(spec: str, target: str) -> Any:
    path = Path(target).expanduser()
    if not path.is_file():
        raise RewardLoadError(
            f"reward spec {spec!r}: file {str(path)!r} does not exist (relative paths are resolved against the "
            f"working directory {os.getcwd()!r}); fix the path or pass an absolute one"
        )
    path = path.resolve()
    # One stable module name per file, registered in sys.modules so dataclasses and
    # pickling inside the file work; executing again gives a fresh module.
    name = f"rl_reward_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise RewardLoadError(f"reward spec {spec!r}: cannot load {str(path)!r} as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise RewardLoadError(
            f"reward spec {spec!r}: executing {str(path)!r} raised {type(e).__name__}: {e}; fix the file"
        ) from e
    return module


def _import_module(spec: str, target: str) -> Any:
    try:
        return importlib.import_module(target)
    except ImportError as e:
        raise RewardLoadError(
            f"reward spec {spec!r}: cannot import module {target!r} ({type(e).__name__}: {e}); install it, fix "
            "the module name, or use a 'path/to/file.py:func' spec"
        ) from e


def _check_signature(fn: Any, where: str) -> None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins and C callables have no signature: trust them
        return
    fix = "define it as fn(prompt, response, label, **info) -> float"
    try:
        sig.bind("prompt", "response", None)
    except TypeError as e:
        raise RewardLoadError(f"reward function {where} cannot be called as fn(prompt, response, label): {e}; {fix}")
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values()):
        raise RewardLoadError(
            f"reward function {where} has signature {sig} without **info (the per-sample extra fields); {fix}"
        )
