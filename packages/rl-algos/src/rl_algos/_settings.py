"""Config plumbing of rl-algos' typed nodes: field metadata for command-line builders (:func:`field_meta`) and
``KEY=VALUE`` texts -> typed settings of a registry entry's own parameters (an estimator's ``params``, a
policy-loss variant's fields beyond the shared ones): how a run sets what an extension adds, from a command
line or a YAML list, without a flag per parameter."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

TRUE, FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


def field_meta(help: str, flat: str | None = None, openrlhf: str | None = None) -> dict:
    """A config field's metadata for command-line builders (its help, our flat flag name, OpenRLHF's name), as
    plain data: rl-algos imports nothing but torch (rl-rollout's ``meta`` is the same shape)."""
    return {"help": help, "flags": (flat,) if flat else (), "openrlhf": (openrlhf,) if openrlhf else ()}


def _typed(text: str, tp: type, key: str, owner: str):
    if tp is bool:
        t = text.strip().lower()
        if t in TRUE | FALSE:
            return t in TRUE
        raise ValueError(f"{owner}: {key}={text!r} is not true or false")
    if tp in (int, float, str):
        try:
            return tp(text)
        except ValueError:
            raise ValueError(f"{owner}: {key}={text!r} is not {'an' if tp is int else 'a'} {tp.__name__}") from None
    raise ValueError(
        f"{owner}: parameter {key!r} has type {tp!r}, which a KEY=VALUE setting cannot give (int, float, bool, str)"
    )


def parse_settings(items: Sequence[str], params: Mapping[str, type], owner: str) -> dict:
    """Each ``KEY=VALUE`` (or a ``(key, value)`` pair) to ``{key: value}`` typed by ``params``; a text without
    ``=``, an unknown key or a bad value fails naming what ``owner`` takes."""
    out: dict = {}
    for item in items:
        if isinstance(item, str):
            key, sep, value = item.partition("=")
            if not sep:
                raise ValueError(f"{owner}: {item!r} is not KEY=VALUE")
        else:
            key, value = item
        key = key.strip()
        if key not in params:
            valid = ", ".join(f"{k} ({t.__name__})" for k, t in params.items()) or "none"
            raise ValueError(f"{owner} has no parameter {key!r}; its parameters: {valid}")
        out[key] = _typed(value, params[key], key, owner) if isinstance(value, str) else value
    return out
