"""The ``rl`` command: dispatches to subcommands.

``rl sft | rm | dpo | kto`` (offline trainers, :mod:`rl_cli.train`), ``rl ppo`` and
``rl ppo-ray`` (the PPO-family RL loop in one process or over Ray, :mod:`rl_cli.ppo`, :mod:`rl_cli.ppo_ray`),
each with ``--help``; ``rl eval`` (models or checkpoints on prompt sets, pass@k / maj@k, :mod:`rl_cli.eval`);
``rl demo`` (GRPO on a tiny model, :mod:`rl_cli.demo`);
``rl --version`` (every package's version) and ``rl doctor`` (what this machine can
run and how to fix what it cannot, :mod:`rl_cli.doctor`), ``rl serve-rm`` (a reward server for
``rl ppo --remote_rm_url`` and OpenRLHF's client, :mod:`rl_cli.serve_rm`). Asking for a
command that does not exist fails with the list of those that do.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as md
import sys

RL_COMMANDS = {
    "ppo": ("ppo:run_local", "PPO / GRPO / REINFORCE++ / RLOO in one process"),
    "ppo-ray": ("ppo_ray:run_ray", "the same RL loop over Ray: a placement plan, actors per role, vLLM/HF engines"),
    "eval": ("eval:main", "evaluate models or checkpoints on prompt sets: pass@k, maj@k, mean reward; no training"),
}
PACKAGES = ("rl-algos", "rl-rollout", "rl-placement", "rl-core", "rl-stack-cli")  # distribution names


def versions() -> dict[str, str]:
    return {p: md.version(p) for p in PACKAGES}


def main(argv: list[str] | None = None) -> int:
    # lazy: rl_cli.train pulls torch; importing rl_cli.main (the `rl` entry point) stays light
    from rl_cli.train import COMMANDS, run

    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in COMMANDS:
        return run(argv[0], argv[1:])
    if argv and argv[0] in RL_COMMANDS:
        module, func = RL_COMMANDS[argv[0]][0].split(":")
        return getattr(importlib.import_module(f"rl_cli.{module}"), func)(argv[1:])
    if argv and argv[0] == "demo":
        # lazy: rl demo's module (rl-core's loop, a tiny model); only `rl demo` loads it
        from rl_cli.demo import main as demo

        return demo(argv[1:])
    if argv and argv[0] == "doctor":
        # lazy: rl doctor's module imports each part it checks; only `rl doctor` loads it
        from rl_cli.doctor import main as doctor

        return doctor(argv[1:])
    if argv and argv[0] == "serve-rm":
        # lazy: rl serve-rm's module (rl-core's models, the reward server); only `rl serve-rm` loads it
        from rl_cli.serve_rm import main as serve_rm

        return serve_rm(argv[1:])
    parser = argparse.ArgumentParser(prog="rl", description="RL for LLMs: SFT, RM, DPO, KTO, PPO/GRPO")
    parser.add_argument("--version", action="store_true", help="print every package's version")
    sub = parser.add_subparsers(dest="command")
    sub.add_parser(
        "doctor",
        help="what this machine can run, each missing part's fix; rl doctor COMMAND FLAGS... exits 1 when that "
        "command cannot run here",
    )
    sub.add_parser("demo", help="GRPO on a tiny model and a synthetic task, CPU, minutes (rl demo --help)")
    sub.add_parser(
        "serve-rm",
        help="serve a reward model or reward functions over HTTP, to rl ppo and OpenRLHF's "
        "client (rl serve-rm --help for its flags)",
    )
    for name, cmd in COMMANDS.items():
        sub.add_parser(name, help=f"{cmd.help} (rl {name} --help for its flags)")
    for name, (_, text) in RL_COMMANDS.items():
        sub.add_parser(name, help=f"{text} (rl {name} --help for its flags)")
    args = parser.parse_args(argv)
    if args.version:
        for name, v in versions().items():
            print(f"{name} {v}")
        return 0
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
