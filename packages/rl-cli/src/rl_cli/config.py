"""Command-line flags derived from the packages' typed config dataclasses (their values, YAML included, are read by
:mod:`rl_cli.loading`).

Help text and extra flag names come from each field's metadata (``help``, ``flags``
for our other names, ``openrlhf`` for OpenRLHF's), written by the package that owns the
config (``rl_rollout.config.meta``). A command names its groups, e.g. ``{"model": ModelArgs, "data": DataConfig,
"strategy": StrategyConfig, "train": SFTConfig}``. Every dataclass field becomes a
dotted flag (``--strategy.zero_stage 3``); a field name that is unique across the
groups is also accepted bare (``--zero_stage 3``), which is how OpenRLHF's flat flags
(``--max_len``, ``--micro_train_batch_size``, ``--save_path`` ...) carry over, and
:data:`ALIASES` maps OpenRLHF names that differ from ours (``--pretrain``, ``--l2``,
``--flash_attn``). ``--config run.yaml`` supplies values first (nested
``strategy: {zero_stage: 3}``, dotted or flat keys); flags on the command line win.
Types come from the annotations: ``int``, ``float``, ``str``, optional ones, booleans
(``--bf16``, ``--bf16 false``) and tuples (``--adam_betas 0.9 0.95``). The dataclasses'
own checks run on the result, so a bad value fails with their message.

Configs are trees: a field whose type is a dataclass is a *node* (``ppo.kl``, ``ppo.ckpt``), its
fields flags dotted by the path (``--ppo.kl.target``); a node field's leaf name is accepted bare
when unique and the field names no flat spelling of its own (``flags``). An optional node
(``AsyncConfig | None``) is absent unless turned on: by its switch when its field's metadata says
``switch=True`` (``--async_train`` turns ``ppo.async_rl`` on; its fields given without it are refused,
naming the switch), else by any of its fields being given (the node's own constructor then checks
what it needs, e.g. ``--agent_max_turns`` without ``--agent_func_path``). In YAML a node is a nested
mapping (present), ``null``/``false`` (absent) or ``true`` (present with its defaults), so
``--print_config``'s YAML reads back through ``--config`` to the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import enum
import types
import typing

from rl_cli import openrlhf

# OpenRLHF flag -> our dotted name, where the names differ.
ALIASES = {
    "pretrain": "model.pretrain",
    "ref_pretrain": "model.ref_pretrain",
    "flash_attn": "model.flash_attn",
    "lora_rank": "model.lora_rank",
    "lora_alpha": "model.lora_alpha",
    "lora_dropout": "model.lora_dropout",
    "l2": "strategy.weight_decay",
    "dataset": "data.dataset",
    "max_samples": "data.max_samples",
    "prompt_data": "data.dataset",  # rl ppo / ppo-ray
    "prompt_max_len": "data.max_len",
}
TRUE, FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}
AUTO = {"auto", "none", "null"}  # an optional setting left unset: its default, auto where the field says so


def parse_bool(text: str) -> bool:
    t = str(text).strip().lower()
    if t in TRUE:
        return True
    if t in FALSE:
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _unwrap_optional(tp):
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
        if str in args:  # e.g. tuple[str, ...] | str: take the text form
            return str, type(None) in typing.get_args(tp)
    return tp, False


def node_type(tp) -> tuple[type, bool] | None:
    """``(cls, optional)`` when a field's type is a config node (a dataclass, or one or None), else None."""
    base, optional = _unwrap_optional(tp)
    return (base, optional) if isinstance(base, type) and dataclasses.is_dataclass(base) else None


def _field_kwargs(tp) -> dict:
    base, optional = _unwrap_optional(tp)
    if isinstance(base, type) and issubclass(base, enum.Enum):  # a StrEnum-like field: its values are the choices

        def member(text: str, cls=base):
            try:
                return cls(text)
            except ValueError:
                raise argparse.ArgumentTypeError(
                    f"{text!r} is not one of {', '.join(str(e.value) for e in cls)}"
                ) from None

        return {"type": member, "metavar": "|".join(str(e.value) for e in base)}
    if base is bool:
        if optional:  # unset means auto (rl_core.rl.auto): "auto" says so explicitly
            return {
                "type": lambda s: None if s.strip().lower() in AUTO else parse_bool(s),
                "nargs": "?",
                "const": True,
                "metavar": "BOOL|auto",
            }
        return {"type": parse_bool, "nargs": "?", "const": True, "metavar": "BOOL"}
    if typing.get_origin(base) is tuple:
        args = typing.get_args(base)
        inner = args[0]
        n = "+" if len(args) == 2 and args[1] is Ellipsis else len(args)
        return {"type": inner, "nargs": n}
    if base in (int, float, str):
        if optional:
            unset = AUTO if base is not str else {"none", "null"}  # a text field may take "auto" as a value
            return {"type": lambda s, b=base: None if s.lower() in unset else b(s)}
        return {"type": base}
    raise TypeError(f"config field type {tp!r} has no command-line form")


@dataclasses.dataclass
class Flag:
    dotted: str  # group.field, or group.node.field for a field of a config node
    group: str
    field: str
    kwargs: dict
    aliases: tuple[str, ...] = ()  # other names from the field's metadata: ours ("flags"), OpenRLHF's ("openrlhf")
    nested: bool = False  # a field of a node below the group (bare only when it has no flat name of its own)
    switch: bool = False  # turns an optional node on (dotted = the node's path)
    shown: str = ""  # the spelling errors name (set by build_parser: a flat name where there is one)


@dataclasses.dataclass(frozen=True)
class Node:
    """A config node below a group: ``path`` (``ppo.async_rl``), its class, whether it may be absent and
    whether a switch flag turns it on."""

    path: str
    cls: type
    optional: bool
    switch: bool


def collect_nodes(groups: dict[str, type]) -> list[Node]:
    out: list[Node] = []

    def walk(prefix: str, cls: type) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            node = node_type(hints[f.name])
            if node is not None and not f.name.startswith("_"):
                out.append(Node(f"{prefix}.{f.name}", node[0], node[1], bool(f.metadata.get("switch"))))
                walk(f"{prefix}.{f.name}", node[0])

    for group, cls in groups.items():
        walk(group, cls)
    return out


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def collect_flags(groups: dict[str, type]) -> list[Flag]:
    flags = []

    def walk(group: str, prefix: str, cls: type) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name.startswith("_"):
                continue
            aliases = tuple(f.metadata.get("flags", ())) + tuple(f.metadata.get("openrlhf", ()))
            note = f.metadata.get("help", "")  # the field's own metadata is the one source of help
            if callable(f.metadata.get("names")):  # a registry's names, read now (extensions imported first)
                note += f"; registered: {', '.join(f.metadata['names']())}"
            node = node_type(hints[f.name])
            if node is not None:
                if node[1] and f.metadata.get("switch"):  # the switch that turns the optional node on
                    kw = _field_kwargs(bool)
                    kw["help"] = f"{note + '; ' if note else ''}default: off".replace("%", "%%")
                    flags.append(Flag(f"{prefix}.{f.name}", group, f.name, kw, aliases, prefix != group, True))
                walk(group, f"{prefix}.{f.name}", node[0])
                continue
            kw = _field_kwargs(hints[f.name])
            default = _default(f)
            shown = default.value if isinstance(default, enum.Enum) else default
            shown = "auto" if shown is None and "(auto)" in note else repr(shown)  # unset: the hardware decides
            kw["help"] = f"{note + '; ' if note else ''}default: {shown}".replace("%", "%%")
            kw.setdefault("metavar", f.name.upper())
            flags.append(Flag(f"{prefix}.{f.name}", group, f.name, kw, aliases, prefix != group))

    for group, cls in groups.items():
        walk(group, group, cls)
    return flags


def field_at(groups: dict[str, type], dotted: str) -> dataclasses.Field:
    """The dataclass field a dotted name sets (``ppo.kl.target`` -> KLConfig's ``target``)."""
    group, *path = dotted.split(".")
    cls = groups[group]
    for i, name in enumerate(path):
        f = next(f for f in dataclasses.fields(cls) if f.name == name)
        if i == len(path) - 1:
            return f
        node = node_type(typing.get_type_hints(cls)[name])
        if node is None:  # a setting, not a node: nothing below it
            raise KeyError(dotted)
        cls = node[0]
    raise KeyError(dotted)


def shown_name(flag: Flag) -> str:
    """The spelling errors name: our flat name, else the bare field name, else the dotted one."""
    if flag.shown:
        return flag.shown
    ours = [a for a in flag.aliases if "." not in a]
    return f"--{ours[0]}" if ours else f"--{flag.dotted}" if flag.nested else f"--{flag.field}"


class _Parser(argparse.ArgumentParser):
    """argparse that suggests the closest known flag for a misspelt one."""

    known: list[str] = []

    def error(self, message: str):
        if "unrecognized arguments" in message:
            bad = [w for w in message.split(":", 1)[1].split() if w.startswith("--")]
            hints = []
            for w in bad:
                close = difflib.get_close_matches(w.split("=")[0], self.known, n=3, cutoff=0.6)
                if close:
                    hints.append(f"{w}: did you mean {', '.join(close)}?")
            if hints:
                message += "\n  " + "\n  ".join(hints)
        super().error(message)


def build_parser(prog: str, description: str, groups: dict[str, type]) -> tuple[argparse.ArgumentParser, list[Flag]]:
    flags = collect_flags(groups)

    def bare_ok(f: Flag) -> bool:  # a node's field with a flat name of its own takes that, not its bare name
        return not ((f.nested or f.switch) and any("." not in a for a in f.aliases))

    counts: dict[str, int] = {}
    for f in flags:
        if bare_ok(f):
            counts[f.field] = counts.get(f.field, 0) + 1
    parser = _Parser(
        prog=prog,
        description=description,
        argument_default=argparse.SUPPRESS,
        usage="%(prog)s [--config FILE.yaml] [--print_config] [--SETTING VALUE ...]",
        epilog="Each setting is listed once, by its flat name (or dotted, where a flat one would be "
        "ambiguous); its dotted name (--GROUP.NODE.NAME) and OpenRLHF's names (both dialects) "
        "are accepted too: docs/openrlhf.md lists them.",
    )
    parser.add_argument("--config", metavar="FILE.yaml", help="read settings from YAML first; flags override it")
    parser.add_argument(
        "--print_config", action="store_true", help="print the resolved settings and the batch arithmetic, then exit"
    )
    by_dotted = {f.dotted: f for f in flags}
    reverse_alias: dict[str, list[str]] = {}
    for alias, dotted in ALIASES.items():
        if dotted in by_dotted:
            reverse_alias.setdefault(dotted, []).append(alias)
    known: list[str] = []
    owner: dict[str, str] = {}
    command = prog.removeprefix("rl ")  # the rl_cli.openrlhf tables are per command
    converted = {f"--{n}" for n in openrlhf.converted_names(command)}  # value reshaped: rl_cli.openrlhf's action
    # --help: one spelling per setting (our flat name where it has one, else the dotted name), in a section per
    # group and per config node; the other spellings (dotted, OpenRLHF's) are accepted but listed only in
    # docs/openrlhf.md, through hidden twins of each action.
    nodes = {n.path: n for n in collect_nodes(groups)}
    sections: dict[str, argparse._ArgumentGroup] = {}
    hidden = parser.add_argument_group("aliases")  # no visible action: argparse prints no empty section

    def section(path: str) -> argparse._ArgumentGroup:
        if path not in sections:
            node = nodes.get(path)
            if node is None:
                sections[path] = parser.add_argument_group(path)
            else:
                note = field_at(groups, path).metadata.get("help", "")
                how = "Off unless its switch below is given. " if node.switch else ""
                sections[path] = parser.add_argument_group(
                    path, f"{note}. {how}Each setting is also --{path}.NAME; in YAML, a mapping at {path}."
                )
        return sections[path]

    for group in groups:
        section(group)
        for f in (f for f in flags if f.group == group):
            names = [f"--{f.dotted}"]
            if bare_ok(f) and counts[f.field] == 1 and f.field not in ALIASES:
                names.append(f"--{f.field}")
            names += [f"--{a}" for a in reverse_alias.get(f.dotted, []) + list(f.aliases)]
            names = [n for n in dict.fromkeys(names) if n == f"--{f.dotted}" or n not in converted]
            for n in names:
                if n in owner:
                    raise TypeError(
                        f"{prog}: flag {n} would set both {owner[n]} and {f.dotted}; rename one "
                        f"(field metadata 'flags'/'openrlhf' or ALIASES)"
                    )
                owner[n] = f.dotted
            f.shown = next((n for n in names[1:] if "." not in n), names[0])
            where = f.dotted if f.switch else f.dotted.rsplit(".", 1)[0]
            section(where).add_argument(f.shown, dest=f.dotted, **f.kwargs)
            others = [n for n in names if n != f.shown]
            if others:
                hidden.add_argument(*others, dest=f.dotted, **{**f.kwargs, "help": argparse.SUPPRESS})
            known += names
    known += openrlhf.install(parser, command, owner, {f.dotted: f.kwargs for f in flags})
    parser.known = known
    return parser, flags
