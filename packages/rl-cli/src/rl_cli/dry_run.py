"""``--print_config``: a dry run of any training command.

It prints what the flags (ours and OpenRLHF's, both dialects), the YAML file and the
defaults resolved to, as YAML (the config tree: one mapping per group, a node per sub-config,
``null`` for an optional one that is off), which ``--config`` reads back to the same run;
then, as YAML comments (``# [rl ppo] ...``), the batch arithmetic
the run would use (global batch = micro batch x accumulation x data-parallel ranks;
for RL: prompts x samples per prompt per iteration, optimizer steps per iteration) and,
for ``rl ppo-ray``, the placement plan's GPU map. It reads no model, no tokenizer and no
dataset, and starts neither DeepSpeed nor Ray: it works with paths that do not exist yet.
Arithmetic that cannot work ends it with exit code 2 and the line saying why.
"""

from __future__ import annotations

import dataclasses
import os

import yaml

from rl_cli.loading import as_plain
from rl_cli.placement_args import plan_from
from rl_core.preflight import check_rl_batches
from rl_core.rl.roles import run_roles


def as_dict(cfgs: dict[str, object]) -> dict[str, dict]:
    return {group: as_plain(cfg) for group, cfg in cfgs.items() if dataclasses.is_dataclass(cfg)}


def as_yaml(cfgs: dict[str, object]) -> str:
    """The config tree as YAML that ``--config`` reads back."""
    return yaml.safe_dump(as_dict(cfgs), sort_keys=False, default_flow_style=False, width=120)


def _say(command: str, text: str) -> None:
    """A line (or lines) of the dry run's report, as YAML comments so the whole output reads back."""
    for line in text.splitlines():
        print(f"# [rl {command}] {line}", flush=True)


def _offline_batches(cfgs: dict) -> list[str]:
    s = cfgs["strategy"]
    world = int(os.environ.get("WORLD_SIZE", "1"))  # under torchrun / deepspeed: the launcher's ranks
    per_step = s.micro_train_batch_size * world
    if s.train_batch_size % per_step:
        raise ValueError(
            f"--train_batch_size {s.train_batch_size} is not a multiple of --micro_train_batch_size "
            f"{s.micro_train_batch_size} x {world} data-parallel rank(s) = {per_step}"
        )
    return [
        f"global batch {s.train_batch_size} = micro batch {s.micro_train_batch_size} x accumulation "
        f"{s.train_batch_size // per_step} x data parallel {world} (WORLD_SIZE)",
        f"optimizer steps = dataset rows // {s.train_batch_size} x {cfgs['train'].max_epochs} epoch(s)",
    ]


def _rl_batches(cfgs: dict, ray: bool) -> list[str]:
    p, s = cfgs["ppo"], cfgs["strategy"]
    world = cfgs["ray"].actor_num_nodes * cfgs["ray"].actor_num_gpus_per_node if ray else 1
    samples = p.rollout_batch_size * p.sampling.n_samples_per_prompt
    g, micro = s.train_batch_size, s.micro_train_batch_size
    check_rl_batches(p, s, world_sizes={"policy": world})  # rl_core.preflight: the one place of these rules
    iters = (
        f"{p.max_iterations} (--max_iterations)"
        if p.max_iterations
        else f"{p.num_episodes} episode(s) x prompts // {p.rollout_batch_size}"
    )
    roles = run_roles(p, reward_model=bool(cfgs["model"].reward_pretrain)).names()
    b, rows = cfgs["batching"], "packed rows" if cfgs["data"].packing else "padded rows"
    budget, _ = b.forward_budget()

    def tokens(n) -> str:
        return "a token budget from free device memory" if n == "memory" else f"at most {n} tokens"

    train_mb = tokens(b.max_tokens_per_gpu) if b.max_tokens_per_gpu else f"{micro} samples"
    fwd_mb = tokens(budget) if budget else f"{b.forward_micro_batch_size or micro} samples"
    return [
        f"per iteration: {p.rollout_batch_size} prompts x {p.sampling.n_samples_per_prompt} samples = {samples} samples",
        f"global batch {g} = micro batch {micro} x accumulation {g // (micro * world)} x data parallel {world}",
        f"micro-batches per rank: {rows}; training {train_mb}, experience forwards {fwd_mb}"
        + (" (the count per step varies; every rank runs the largest)" if b.max_tokens_per_gpu else ""),
        f"optimizer steps per iteration (each trained model): {samples} // {g} x {p.max_epochs} epoch(s) = "
        f"{samples // g * p.max_epochs}",
        f"iterations: {iters}",
        f"estimator {p.advantage.estimator}, policy loss {p.policy_loss.type}; models: {', '.join(roles)}",
    ]


def print_config(command: str, cfgs: dict, chosen=()) -> None:
    """Print the resolved config, the settings the builder chose itself (``chosen``: rl_core.rl.auto's choices),
    the batch arithmetic and (ppo-ray) the GPU map; SystemExit(2) if it cannot work."""
    print(as_yaml(cfgs), end="")
    for choice in chosen:
        _say(command, f"chosen (auto): {choice}")
    ray = command == "ppo-ray"
    try:
        lines = _rl_batches(cfgs, ray) if "ppo" in cfgs else _offline_batches(cfgs)
    except ValueError as e:
        _say(command, f"the batch arithmetic cannot work: {e}")
        raise SystemExit(2) from None
    for line in lines:
        _say(command, line)
    if ray:
        # lazy: rl-placement imports ray; `rl ppo --help` stays light
        from rl_placement import PlacementError

        try:
            plan = plan_from(cfgs["ray"], cfgs["ppo"], cfgs["model"])
        except PlacementError as e:
            _say(command, f"the placement cannot work: {e}")
            raise SystemExit(2) from None
        _say(command, f"placement:\n{plan.describe()}")
    _say(command, "dry run (--print_config): nothing loaded, nothing started")
