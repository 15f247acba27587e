"""OpenRLHF's flags, both dialects, onto our configs: every one maps onto a field or is refused in one line.

:file:`openrlhf_flags.json` lists, per command, the flags of OpenRLHF's own argparse
definitions (``scripts/extract_openrlhf_flags.py`` reads them from its releases: the flat
dialect of v0.10.1 and before, the grouped ``--actor.*`` / ``--train.*`` dialect of its
latest release). Most are accepted by the fields' own metadata (``openrlhf=(...)``) or by a
bare field name; the rest are settled by three tables (:mod:`rl_cli.openrlhf_tables`), one line per flag:

- :data:`ALIAS`: OpenRLHF name -> our dotted field(s), the first one the command has;
- :data:`CONVERT`: names whose value needs converting (``--eps_clip_low_high LOW HIGH``,
  ``--target_modules q_proj v_proj``, ``--ds.param_dtype bf16`` ...);
- :data:`REFUSED`: why we do not take it and what to use instead. ``off`` values (the
  ones that mean "feature off" in OpenRLHF, e.g. ``--ring_attn_size 1``) are accepted as
  the no-ops they are; anything else stops the parse with the one line.

Per-command lines (:data:`COMMAND_CONVERT`, :data:`COMMAND_REFUSED`) come first: ``--ckpt.load_enable``
brings the command's own default folder (OpenRLHF's ``./ckpt/checkpoints_sft`` ...).

A refusal whose feature gets built turns into an ``ALIAS`` line (or simply disappears: a
real flag of the same name always wins). ``python -m rl_cli.openrlhf > docs/openrlhf.md``
writes the table from the parsers themselves, and the tests fail when an OpenRLHF flag of
the list is neither accepted nor refused, or when the docs drift from the code.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any

from rl_cli.openrlhf_tables import (  # noqa: F401  (the tables' names, re-exported)
    ALIAS,
    COMMAND_CONVERT,
    COMMAND_REFUSED,
    COMMANDS,
    CONVERT,
    DEFAULTS,
    FLAGS_FILE,
    NOTES,
    REFUSED,
    Convert,
    Refuse,
    command_refusal,
    convert_of,
    converted_names,
    flags_of,
    openrlhf_flags,
)

# ----- argparse actions ---------------------------------------------------------------------------


class _Converted(argparse.Action):
    def __init__(self, option_strings, dest, conv: Convert, **kw):
        self.conv = conv
        super().__init__(option_strings, dest, nargs=conv.nargs, type=conv.type if conv.nargs != 0 else None, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        try:
            out = self.conv.convert(values, namespace)
        except ValueError as e:
            parser.error(f"{option_string} {e}")
        for k, v in out.items():
            setattr(namespace, k, v)


def _is_off(values, off: tuple) -> bool:
    if not off:
        return False
    vals = values if isinstance(values, list) else [values]
    if not vals:
        return False

    def same(a, b):
        try:
            return float(a) == float(b)
        except (TypeError, ValueError):
            return str(a) == str(b)

    return all(any(same(v, o) for o in off) for v in vals)


class _Refused(argparse.Action):
    def __init__(self, option_strings, dest, refuse: Refuse, switch: bool, **kw):
        self.refuse = refuse
        super().__init__(option_strings, dest, nargs=0 if switch else "*", **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        if _is_off(values, self.refuse.off):
            return  # the value that leaves the feature off in OpenRLHF: nothing to do here either
        parser.error(f"{option_string} (OpenRLHF) is not supported: {self.refuse.why}")


def install(
    parser: argparse.ArgumentParser, command: str | None, owner: dict[str, str], kwargs_of: dict[str, dict]
) -> list[str]:
    """Add the command's OpenRLHF flags that the fields did not already give; returns the names added."""
    if command not in COMMANDS:
        return []
    flags = {**flags_of(command)["grouped"], **flags_of(command)["flat"]}
    group = parser.add_argument_group("OpenRLHF names (docs/openrlhf.md)")
    added = []
    for name, shape in sorted(flags.items()):
        opt = f"--{name}"
        if opt in owner:
            continue
        # a refusal of this command first, then what maps onto a field of ours, then the general refusal
        refuse = command_refusal(command, name)
        conv = convert_of(command, name)
        target = next((t for t in ALIAS.get(name, ()) if t in kwargs_of), None)
        if refuse is None and conv is None and target is None:
            refuse = REFUSED.get(name)
        if refuse is None and conv is not None:
            meta: dict[str, Any] = {} if conv.nargs == 0 else {"metavar": name.split(".")[-1].upper()}
            group.add_argument(
                opt, action=_Converted, conv=conv, dest=argparse.SUPPRESS, help=argparse.SUPPRESS, **meta
            )  # docs/openrlhf.md: "sets {conv.ours}"
            owner[opt] = f"openrlhf:{name}"
        elif refuse is None and target is not None:
            group.add_argument(opt, dest=target, **{**kwargs_of[target], "help": argparse.SUPPRESS})
            owner[opt] = target
        elif refuse is not None:
            group.add_argument(
                opt,
                action=_Refused,
                refuse=refuse,
                switch=shape.get("action") == "store_true",
                dest=argparse.SUPPRESS,
                help=argparse.SUPPRESS,
            )
            owner[opt] = f"refused:{name}"
        else:
            continue  # missing from every table: tests/test_openrlhf_flags.py names it
        added.append(opt)
    return added


# ----- the table: docs/openrlhf.md ----------------------------------------------------------------


def groups_of(command: str) -> dict[str, type]:
    if command in ("ppo", "ppo-ray"):
        # lazy: import cycle (rl_cli.config -> rl_cli.openrlhf -> rl_cli.ppo -> rl_cli.config)
        from rl_cli import ppo

        return ppo._groups(command == "ppo-ray")
    # lazy: import cycle (rl_cli.config -> rl_cli.openrlhf -> rl_cli.train -> rl_cli.config)
    from rl_cli import train

    return train._groups(train.COMMANDS[command])


def parser_of(command: str) -> argparse.ArgumentParser:
    """The command's real parser (the one ``rl COMMAND`` runs), built without loading anything heavy."""
    # lazy: import cycle (rl_cli.config -> rl_cli.openrlhf -> rl_cli.config)
    from rl_cli.config import build_parser

    return build_parser(f"rl {command}", command, groups_of(command))[0]


def _default_gap(command: str, dest: str, shape: dict) -> str:
    """'X / Y' (OpenRLHF's default / ours) where a run that omits the flag would differ; else ''."""
    theirs = shape.get("default")
    if shape.get("action") == "store_true" and theirs is None:
        theirs = False
    if isinstance(theirs, str) and ("(" in theirs or "%" in theirs):  # an expression or a run-name pattern
        return ""
    # lazy: import cycle (rl_cli.config -> rl_cli.openrlhf -> rl_cli.config)
    from rl_cli.config import field_at

    f = field_at(groups_of(command), dest)
    ours = (
        f.default
        if f.default is not dataclasses.MISSING
        else (f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
    )
    same = theirs == ours or (isinstance(theirs, list) and ours is not None and tuple(theirs) == tuple(ours))
    auto = ours is None and "auto" in f.metadata.get("help", "")  # unset: the hardware decides (rl_core.rl.auto)
    return "" if same else f"{theirs!r} / {'auto' if auto else repr(ours)}"


@dataclass(frozen=True)
class Row:
    flag: str
    dialect: str
    ours: str
    status: str  # "accepted" | "refused" | "MISSING"
    why: str = ""
    defaults: str = ""  # "OpenRLHF X / ours Y" where a run that omits the flag differs


def rows(command: str) -> list[Row]:
    # lazy: import cycle (rl_cli.config -> rl_cli.openrlhf -> rl_cli.ppo -> rl_cli.config)
    from rl_cli.ppo import UNUSED_BY_RL

    parser = parser_of(command)
    acts = parser._option_string_actions
    out = []
    for dialect in ("flat", "grouped"):
        for name, shape in flags_of(command)[dialect].items():
            act = acts.get(f"--{name}")
            if act is None:
                out.append(Row(name, dialect, "", "MISSING"))
            elif isinstance(act, _Refused):
                off = f" (accepted as a no-op: {', '.join(map(str, act.refuse.off))})" if act.refuse.off else ""
                out.append(Row(name, dialect, "", "refused", act.refuse.why + off))
            elif isinstance(act, _Converted):
                out.append(Row(name, dialect, act.conv.ours, "accepted", NOTES.get((command, name), "")))
            elif (
                command in ("ppo", "ppo-ray")
                and act.dest.split(".")[-1] in UNUSED_BY_RL
                and act.dest.startswith("data.")
            ):
                out.append(Row(name, dialect, act.dest, "refused", UNUSED_BY_RL[act.dest.split(".")[-1]]))
            else:
                out.append(
                    Row(
                        name,
                        dialect,
                        act.dest,
                        "accepted",
                        NOTES.get((command, name), ""),
                        _default_gap(command, act.dest, shape),
                    )
                )
    return out


def markdown() -> str:
    data = openrlhf_flags()
    lines = [
        "# OpenRLHF flags in rl",
        "",
        "<!-- generated by `python -m rl_cli.openrlhf > docs/openrlhf.md`; edit the tables in "
        "packages/rl-cli/src/rl_cli/openrlhf_tables.py (or a field's `openrlhf=` metadata), not this file -->",
        "",
        "Every flag of OpenRLHF's own argument definitions works here under the same name, or stops the run "
        "with one line saying why and what to use instead; nothing is ignored. Both dialects: the flat flags "
        "of the releases up to v0.10.1 (`--actor_learning_rate`, `--micro_rollout_batch_size` ...) and the "
        "grouped flags of its latest release (`--actor.adam.lr`, `--train.batch_size` ...). The lists come "
        "from OpenRLHF's `openrlhf/cli/train_*.py` (packages/rl-cli/scripts/extract_openrlhf_flags.py) at:",
        "",
    ]
    for tag, commit in data["releases"].items():
        lines.append(f"- {tag}: {data['source']}/tree/{commit}")
    lines += [
        "",
        "OpenRLHF's example scripts (`examples/scripts/`), one by one, and what stops those that do not run: "
        "[packages/rl-cli/README.md](../packages/rl-cli/README.md#openrlhfs-example-scripts).",
        "",
        "`python -m openrlhf.cli.train_X` becomes `python -m rl_cli.train_X` or `rl X`. `ours` is the "
        "setting the flag sets (`rl X --print_config` shows them all resolved). A refused flag given "
        "the value that leaves its feature off in OpenRLHF (e.g. `--ring_attn_size 1`) is accepted as the "
        "no-op it is. The last column shows where a run that leaves a flag out differs from OpenRLHF's "
        "(pass the flag to get OpenRLHF's value; `None` on our side means derived, see `rl X --help`).",
        "",
        "`rl ppo-ray` also places a role OpenRLHF has no flag for: on-policy distillation's teacher "
        "(`--teacher_pretrain`), on `--teacher_num_nodes` x `--teacher_num_gpus_per_node` GPUs (default: the "
        "reference's counts), in its own placement group, or with the policy (and the reference) under "
        "`--colocate_actor_ref`, and in the hybrid group under `--colocate_all_models`; `--teacher_offload` "
        "keeps its parameters on the CPU as `--ref_offload` does the reference's.",
        "",
    ]
    for command in COMMANDS:
        rs = rows(command)
        acc = sum(r.status == "accepted" for r in rs)
        src = sorted({s["from"] for d in flags_of(command).values() for s in d.values()})
        lines += [
            f"## rl {command}",
            "",
            f"{len(rs)} OpenRLHF flags ({', '.join(src)}): {acc} accepted, {len(rs) - acc} refused.",
            "",
            "| OpenRLHF flag | ours | status | default: OpenRLHF / ours, where they differ |",
            "|---|---|---|---|",
        ]
        for r in rs:
            status = r.status if not r.why else f"{r.status}: {r.why}"
            cells = [f"`--{r.flag}`", f"`{r.ours}`" if r.ours else "", status, f"`{r.defaults}`" if r.defaults else ""]
            lines.append("| " + " | ".join(c.replace("|", "&#124;") for c in cells) + " |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    from rl_cli import openrlhf  # the parsers use that module's actions, not this __main__ copy's

    print(openrlhf.markdown(), end="")
