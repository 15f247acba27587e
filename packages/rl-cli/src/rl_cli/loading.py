"""Loading a command's settings: ``--config`` YAML and the command line into one instance per group, and back.

:func:`settings` gathers ``{dotted: value}`` (OpenRLHF's defaults its flags bring < YAML < command line),
:func:`build` turns them into the config dataclasses (nodes built or left absent; the dataclasses validate),
:func:`resolve` is both; :func:`given` is what the user set (what ``auto`` choices must not touch);
:func:`as_plain` is a config tree as plain data, what ``--print_config`` writes and ``--config`` reads back.
The flags themselves (names, types, help) come from :mod:`rl_cli.config`.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import enum
import typing
from pathlib import Path
from typing import Any

from rl_cli import openrlhf
from rl_cli.config import ALIASES, Flag, Node, collect_nodes, node_type, shown_name


def _flatten_yaml(data: dict | None, groups: dict[str, type], flags: list[Flag], source: str) -> dict[str, object]:
    by_dotted = {f.dotted: f for f in flags}
    by_field: dict[str, list[Flag]] = {}
    for f in flags:
        by_field.setdefault(f.field, []).append(f)
    by_alias = {a: f.dotted for f in flags for a in f.aliases}
    nodes = {n.path: n for n in collect_nodes(groups)}
    out: dict[str, object] = {}

    def coerce(dotted: str, value):  # YAML reads 1e-5 as text; apply the flag's own parser
        kw = by_dotted[dotted].kwargs
        if isinstance(value, str) and kw["type"] is not str:
            try:
                return kw["type"](value)
            except (ValueError, argparse.ArgumentTypeError) as e:
                raise ValueError(f"{source}: {dotted} = {value!r}: {e}") from None
        return value

    def below(prefix: str, name: str) -> str | None:
        """A flat name given inside a group's or node's mapping (``ppo: {max_staleness: 2}``, the layout of
        files written before that setting moved into a node): the one setting of that name below it."""
        hits = {
            d
            for d in ([by_alias[name]] if name in by_alias else []) + [f.dotted for f in by_field.get(name, [])]
            if d.startswith(prefix + ".")
        }
        return hits.pop() if len(hits) == 1 else None

    def put(key: str, value):
        if key not in by_dotted and "." in key and (moved := below(*key.rsplit(".", 1))):
            key = moved
        if key in by_dotted:
            out[key] = coerce(key, value)
        elif key in ALIASES and ALIASES[key] in by_dotted:
            out[ALIASES[key]] = coerce(ALIASES[key], value)
        elif key in by_alias:
            out[by_alias[key]] = coerce(by_alias[key], value)
        elif len(by_field.get(key, [])) == 1:
            out[by_field[key][0].dotted] = coerce(by_field[key][0].dotted, value)
        elif key in by_field:
            raise ValueError(
                f"{source}: key {key!r} is ambiguous; write one of {', '.join(f.dotted for f in by_field[key])}"
            )
        else:
            close = difflib.get_close_matches(key, list(by_dotted) + list(by_field), n=3, cutoff=0.6)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ValueError(f"{source}: unknown setting {key!r}{hint}")

    def put_node(node: Node, value) -> None:
        """A node's value: a mapping (present, with these settings), null/false (absent), true (present)."""
        if isinstance(value, dict):
            if node.switch:
                out[node.path] = True
            for k, v in value.items():
                at = f"{node.path}.{k}"
                put_node(nodes[at], v) if at in nodes else put(at, v)
        elif value is None or isinstance(value, bool):
            if node.switch:
                out[node.path] = bool(value)
            elif value:
                out.setdefault(f"{node.path}.", True)  # present with its defaults (the marker resolve reads)
        else:
            raise ValueError(
                f"{source}: {node.path} is a group of settings: write a mapping, true, or null (absent), got {value!r}"
            )

    for key, value in (data or {}).items():
        if key in groups and isinstance(value, dict):
            for k, v in value.items():
                at = f"{key}.{k}"
                put_node(nodes[at], v) if at in nodes else put(at, v)
        else:
            put(str(key), value)
    return out


def _build(cls: type, prefix: str, values: dict[str, object], names: dict[str, str]):
    """One instance of ``cls`` from the dotted ``values`` under ``prefix``, its nodes built (or left absent)
    first; the dataclasses validate."""
    hints = typing.get_type_hints(cls)
    kw = {}
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.name}"
        node = node_type(hints[f.name])
        if node is None:
            if key in values:
                v = values[key]
                kw[f.name] = tuple(v) if isinstance(v, list) else v
            continue
        sub_cls, optional = node
        given = sorted(k for k in values if k.startswith(key + ".") and k != key + ".")
        if optional:
            switch = bool(f.metadata.get("switch"))
            on = bool(values.get(key)) if switch else bool(given) or (key + ".") in values
            if switch and not on and given:
                shown = ", ".join(names.get(k, f"--{k}") for k in given)
                raise ValueError(
                    f"{shown} set{'s' if len(given) == 1 else ''} {names.get(key, '--' + key)}'s "
                    f"settings: add {names.get(key, '--' + key)}, or drop "
                    f"{'it' if len(given) == 1 else 'them'}"
                )
            if not on:
                continue  # an optional node's default: absent
        elif not given and (key + ".") not in values:
            continue  # the node's default
        kw[f.name] = _build(sub_cls, key, values, names)
    return cls(**kw)


def resolve(groups: dict[str, type], args: argparse.Namespace, flags: list[Flag]) -> dict[str, Any]:
    """Defaults < OpenRLHF's defaults its flags bring < YAML < command line -> one instance per group (the
    dataclasses validate)."""
    return build(groups, settings(groups, args, flags), flags)


def given(groups: dict[str, type], args: argparse.Namespace, flags: list[Flag]) -> frozenset[str]:
    """The dotted settings the user set, in YAML or on the command line (what auto choices must not touch)."""
    return frozenset(k for k in settings(groups, args, flags, openrlhf_defaults=False) if not k.endswith("."))


def settings(
    groups: dict[str, type], args: argparse.Namespace, flags: list[Flag], *, openrlhf_defaults: bool = True
) -> dict[str, Any]:
    """``{dotted: value}`` of every setting given: OpenRLHF's defaults its flags bring, YAML, command line."""
    values: dict[str, Any] = dict(getattr(args, openrlhf.DEFAULTS, {})) if openrlhf_defaults else {}
    cfg_file = getattr(args, "config", None)
    if cfg_file:
        # lazy: PyYAML only when a --config file is read
        import yaml

        path = Path(cfg_file)
        if not path.is_file():
            raise FileNotFoundError(f"--config {cfg_file}: no such file")
        try:
            data = yaml.safe_load(path.read_text())
        except yaml.YAMLError as e:
            raise ValueError(f"--config {cfg_file} is not valid YAML: {e}") from None
        if data is not None and not isinstance(data, dict):
            raise ValueError(f"--config {cfg_file}: expected a mapping of settings, got {type(data).__name__}")
        values.update(_flatten_yaml(data, groups, flags, f"--config {cfg_file}"))
    values.update({k: v for k, v in vars(args).items() if "." in k})
    return values


def build(groups: dict[str, type], values: dict[str, object], flags: list[Flag]) -> dict[str, Any]:
    """One instance per group from :func:`settings`' values (the dataclasses validate); a group's instance is
    its dataclass, so the values are typed Any."""
    names = {f.dotted: shown_name(f) for f in flags}
    out: dict[str, Any] = {}
    for group, cls in groups.items():
        try:
            out[group] = _build(cls, group, values, names)
        except TypeError as e:
            raise ValueError(f"{group} settings: {e}") from None
    return out


def as_plain(cfg) -> dict:
    """A config tree as plain data (nodes as mappings, absent ones as None, enums as their values, tuples as
    lists): what ``--print_config`` writes and ``--config`` reads back."""

    def plain(v):
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            return {f.name: plain(getattr(v, f.name)) for f in dataclasses.fields(v) if not f.name.startswith("_")}
        if isinstance(v, enum.Enum):
            return v.value
        if isinstance(v, (tuple, list)):
            return [plain(x) for x in v]
        return v

    return plain(cfg)


def describe(configs: dict[str, object]) -> str:
    lines = []

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}", v)
        else:
            lines.append(f"  {prefix} = {value!r}")

    for group, obj in configs.items():
        walk(group, as_plain(obj))
    return "\n".join(lines)
