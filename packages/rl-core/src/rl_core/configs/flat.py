"""Flat names onto a config tree: ``PPOConfig.from_flat(init_kl_coef=0, async_train=True, max_staleness=2)``.

The migration path from rl-core 0.15's flat ``PPOConfig`` and the Python face of the command line's flat
flags: a name is a node field's own flat name (its ``flags`` metadata: ``init_kl_coef`` -> ``kl.init_coef``,
``async_train`` -> the ``async_rl`` node's switch), else a field's own name (``max_staleness`` ->
``async_rl.max_staleness``, ``n_samples_per_prompt`` -> the top level's). The table comes from the fields'
metadata, the same that rl-cli reads for its flags, so the two never disagree.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing


def node_type(tp) -> tuple[type, bool] | None:
    """``(cls, optional)`` when a field's type is a config node (a dataclass, or one or None), else None."""
    optional = False
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        optional = len(args) < len(typing.get_args(tp))
        tp = args[0] if len(args) == 1 else tp
    return (tp, optional) if isinstance(tp, type) and dataclasses.is_dataclass(tp) else None


def flat_table(cls: type) -> dict[str, tuple[tuple[str, ...], bool]]:
    """``{flat name: (path, is_switch)}`` of a config tree; a name two fields would claim is left out."""
    out: dict[str, tuple[tuple[str, ...], bool]] = {}
    clashes: set[str] = set()

    def add(name: str, entry) -> None:
        if name in out and out[name] != entry:
            clashes.add(name)
        out[name] = entry

    def walk(c: type, prefix: tuple[str, ...]) -> None:
        hints = typing.get_type_hints(c)
        for f in dataclasses.fields(c):
            path, own = prefix + (f.name,), [a for a in f.metadata.get("flags", ()) if "." not in a]
            node = node_type(hints[f.name])
            if node is not None:
                if f.metadata.get("switch"):
                    for n in own:
                        add(n, (path, True))
                walk(node[0], path)
                continue
            for n in own or [f.name]:
                add(n, (path, False))
            if not prefix:
                add(f.name, (path, False))

    walk(cls, ())
    return {k: v for k, v in out.items() if k not in clashes}


def from_flat(cls: type, **flat):
    """An instance of the config tree ``cls`` from flat names; a node is built when a name of it is given
    (an optional one with a switch only when its switch is true: its settings without it are a ValueError)."""
    table = flat_table(cls)
    values: dict[tuple[str, ...], object] = {}
    switches: dict[tuple[str, ...], bool] = {}
    for name, value in flat.items():
        if name not in table:
            close = difflib.get_close_matches(name, list(table), n=3, cutoff=0.6)
            raise TypeError(
                f"{cls.__name__}.from_flat: unknown setting {name!r}"
                + (f"; did you mean {', '.join(close)}?" if close else "")
            )
        path, switch = table[name]
        if switch:
            switches[path] = bool(value)
        else:
            values[path] = value
    by_path = {v: k for k, v in table.items()}

    def build(c: type, prefix: tuple[str, ...]):
        hints, kw = typing.get_type_hints(c), {}
        for f in dataclasses.fields(c):
            path = prefix + (f.name,)
            node = node_type(hints[f.name])
            if node is None:
                if path in values:
                    kw[f.name] = values[path]
                continue
            given = [p for p in values if p[: len(path)] == path]
            if node[1] and f.metadata.get("switch"):
                on = switches.get(path, False)
                if given and not on:
                    switch = by_path.get((path, True), ".".join(path))
                    shown = ", ".join(by_path.get((p, False), ".".join(p)) for p in given)
                    raise ValueError(f"{shown} set {switch}'s settings: add {switch}=True, or drop them")
                if on:
                    kw[f.name] = build(node[0], path)
                elif path in switches:
                    kw[f.name] = None
            elif given:
                kw[f.name] = build(node[0], path)
        return c(**kw)

    return build(cls, ())
