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

OpenRLHF's reward files are batch functions, ``reward_func(queries, prompts,
labels, **kwargs)``, returning a tensor of rewards or the dict ``{"rewards",
"scores", "extra_logs"}``: :func:`load_openrlhf_reward_func` loads one (run it
with :class:`rl_rollout.rewards.openrlhf.OpenRLHFRewardFunc`) and
:func:`record_from` reads what it returned, or what a reward server replied, into a
:class:`RewardRecord`. The per-sample loader refuses such a function with the way
to pass it instead.

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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

SPEC_FORMS = "'path/to/file.py:func', 'package.module:func' or 'builtin:NAME' (exact_match, math, format:REGEX)"


class RewardFn(Protocol):
    def __call__(self, prompt: str, response: str, label: str | None, **info: Any) -> float: ...


RewardSpec = str | RewardFn


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


OPENRLHF_HINT = (
    "an OpenRLHF reward file (reward_func(queries, prompts, labels, **kwargs) -> tensor | "
    "{'rewards', 'scores', 'extra_logs'}) goes to --remote_rm_url FILE.py, as in OpenRLHF"
)


def _load_string(spec: str) -> RewardFn:
    if spec.startswith("builtin:"):
        # lazy: import cycle with rewards.verifiers (it raises this module's RewardLoadError)
        from rl_rollout.rewards.verifiers import make_builtin

        return make_builtin(spec.removeprefix("builtin:"))
    target, sep, attr = spec.rpartition(":")
    if spec.endswith(".py") and (not sep or len(target) == 1):  # "x.py", "C:/x.py": a file, no function
        raise RewardLoadError(
            f"reward spec {spec!r} names a file but no function: write '{spec}:func' for a per-sample "
            f"fn(prompt, response, label, **info) -> float; {OPENRLHF_HINT}"
        )
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
    try:
        return exec_file(path, "rl_reward")  # executing again gives a fresh module
    except Exception as e:
        raise RewardLoadError(
            f"reward spec {spec!r}: executing {str(path.resolve())!r} raised {type(e).__name__}: {e}; fix the file"
        ) from e


def exec_file(path: str | Path, prefix: str, *, reuse: bool = False):
    """A Python file executed as a module (reward files; rl-cli's ``--extension``): one stable name per file,
    ``{prefix}_{stem}_{hash}``, registered in sys.modules so dataclasses and pickling inside the file work.
    ``reuse``: the module already executed under that name, if any (else the file runs again, a fresh module).
    What the file raises propagates, and the name is unregistered; ImportError if it cannot be loaded."""
    path = Path(path).expanduser().resolve()
    name = f"{prefix}_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    if reuse and name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise ImportError(f"cannot load {str(path)!r} as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
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
    first = next(iter(sig.parameters), None)
    if first == "queries":  # OpenRLHF's batch signature would be called with one prompt string as `queries`
        raise RewardLoadError(
            f"reward function {where} takes (queries, ...): OpenRLHF's batch form, not a per-sample function; "
            f"{OPENRLHF_HINT}"
        )
    try:
        sig.bind("prompt", "response", None)
    except TypeError as e:
        raise RewardLoadError(
            f"reward function {where} cannot be called as fn(prompt, response, label): {e}; {fix}"
        ) from e
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values()):
        raise RewardLoadError(
            f"reward function {where} has signature {sig} without **info (the per-sample extra fields); {fix}"
        )


# ----- OpenRLHF's batch reward functions and what they return ------------------------------


@dataclass(frozen=True)
class RewardRecord:
    """One batch's rewards as OpenRLHF's reward functions and reward servers return them.

    ``rewards`` drive the advantages; ``scores`` (None: not given, use the rewards) drive
    dynamic filtering; ``extra_logs`` are per-sample values that the loop averages into its
    metrics (OpenRLHF logs them to wandb).
    """

    rewards: list[float]
    scores: list[float] | None = None
    extra_logs: dict[str, list[float]] = field(default_factory=dict)

    def log_means(self) -> dict[str, float]:
        """Each extra log averaged over the batch (how OpenRLHF reports them)."""
        return {k: sum(v) / len(v) for k, v in self.extra_logs.items() if v}

    def as_json(self) -> dict[str, Any]:
        """The reply body of a reward server: OpenRLHF's ``{"rewards", "scores", "extra_logs"}`` (every key
        present, ``scores`` = ``rewards`` when not given: older OpenRLHF clients read all three)."""
        scores = self.rewards if self.scores is None else self.scores
        return {"rewards": self.rewards, "scores": scores, "extra_logs": self.extra_logs}


def _numbers(value: Any, n: int, what: str, where: str, *, broadcast: bool = False) -> list[float]:
    """``value`` (tensor, array, list, or a scalar when ``n == 1`` / ``broadcast``) as ``n`` finite floats."""
    if hasattr(value, "detach"):  # a torch tensor, maybe on a GPU
        value = value.detach().cpu()
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        if n == 1 or broadcast:
            value = [value] * n
    if isinstance(value, (list, tuple)) and len(value) == n and all(isinstance(x, list) and len(x) == 1 for x in value):
        value = [x[0] for x in value]  # shape [n, 1]
    if not isinstance(value, (list, tuple)) or len(value) != n:
        got = f"{type(value).__name__} of length {len(value)}" if isinstance(value, (list, tuple)) else repr(value)
        raise ValueError(f"{where}: {what} must hold {n} numbers (one per sample), got {got:.200}")
    out = []
    for x in value:
        if isinstance(x, bool) or not isinstance(x, numbers.Real):
            raise ValueError(f"{where}: {what} must be numbers, got {type(x).__name__} {x!r:.80}")
        if not math.isfinite(x):
            raise ValueError(f"{where}: {what} holds a non-finite value {x!r}; return finite numbers")
        out.append(float(x))
    return out


def record_from(value: Any, n: int, where: str) -> RewardRecord:
    """Read a batch reward return: a tensor / array / list of ``n`` rewards, an already built
    :class:`RewardRecord`, or OpenRLHF's dict ``{"rewards", "scores"?, "extra_logs"?}``.

    Raises ValueError naming ``where`` and what was wrong. ``extra_logs`` values may be per-sample
    sequences or one number (a batch statistic such as an accuracy: repeated for each sample, so its
    mean is unchanged).
    """
    if isinstance(value, RewardRecord):
        value = {"rewards": value.rewards, "scores": value.scores, "extra_logs": value.extra_logs}
    if not isinstance(value, Mapping):
        return RewardRecord(_numbers(value, n, "the rewards", where))
    if "rewards" not in value:
        raise ValueError(
            f"{where}: a dict return needs a 'rewards' key (got keys {sorted(map(str, value))}); "
            "return {'rewards': ..., 'scores': ..., 'extra_logs': {...}} or a tensor of rewards"
        )
    rewards = _numbers(value["rewards"], n, "'rewards'", where)
    scores = None if value.get("scores") is None else _numbers(value["scores"], n, "'scores'", where)
    logs_in = value.get("extra_logs") or {}
    if not isinstance(logs_in, Mapping):
        raise ValueError(f"{where}: 'extra_logs' must be a dict of name -> values, got {type(logs_in).__name__}")
    logs = {str(k): _numbers(v, n, f"extra_logs[{k!r}]", where, broadcast=True) for k, v in logs_in.items()}
    return RewardRecord(rewards, scores, logs)


def load_openrlhf_reward_func(path: str | os.PathLike) -> Any:
    """``reward_func`` from an OpenRLHF reward file, executed as a fresh module (OpenRLHF's convention:
    a ``.py`` path given as the remote reward URL is a local reward function named ``reward_func``)."""
    spec = str(path)
    module = _exec_file(spec, spec)
    fn = getattr(module, "reward_func", None)
    if not callable(fn):
        defined = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise RewardLoadError(
            f"OpenRLHF reward file {spec!r} defines no function reward_func (callables there: {defined}); "
            "OpenRLHF calls reward_func(queries, prompts, labels, **kwargs): define it, or pass a per-sample "
            f"function as --reward_fn '{spec}:NAME'"
        )
    try:
        inspect.signature(fn).bind([], [], [])
    except TypeError as e:
        raise RewardLoadError(
            f"OpenRLHF reward file {spec!r}: reward_func cannot be called as reward_func(queries, prompts, "
            f"labels): {e}; define it as reward_func(queries, prompts, labels, **kwargs)"
        ) from None
    except ValueError:  # no signature to check (a C callable): trust it
        pass
    return fn


def query_texts(prompts: Sequence[str], responses: Sequence[str]) -> list[str]:
    """OpenRLHF's ``queries``: each prompt followed by its response (the text the policy saw and wrote)."""
    return [p + r for p, r in zip(prompts, responses, strict=True)]
