"""``rl ppo`` (one process) and ``rl ppo-ray`` (Ray actors per role): the PPO-family RL loop from flags.

Both build the same :class:`rl_core.trainers.ppo.PPOTrainer` over rl-core's role
workers; they differ in where the workers live:

- ``rl ppo``: every role in this process (:class:`rl_core.rl.groups.LocalGroup`), the
  rollout engine too (vLLM when usable, else transformers), weights handed over in
  memory. Single controller, one rank per role.
- ``rl ppo-ray``: a :class:`rl_placement.PlacementPlan` from OpenRLHF's flags
  (``--actor_num_gpus_per_node``, ``--vllm_num_engines``, ``--colocate_*``...),
  validated before any actor starts and printed as a GPU map; one Ray actor per rank
  of each role (DeepSpeed data parallel across an actor group), one per engine, and
  weights broadcast over rl-rollout's collective transport (NCCL between GPUs, gloo
  otherwise) or, for the hybrid engine on GPUs (``--colocate_all_models``), read in
  place over CUDA IPC by the engine that shares each actor rank's GPU. Without a
  cluster it starts a local Ray; ``--num_gpus N`` declares N logical GPUs on a
  machine without any (how the tests run it on CPU).

The flags come from config classes that import no torch (``rl ppo --help`` answers without it); what loads
models, data and the loop is imported where a run reaches it.

Rewards: ``--reward_fn`` (``file.py:func``, ``module:func``, ``builtin:math`` ...)
run by a :class:`rl_rollout.RewardRunner` (every call bounded by ``--reward_timeout``; a
call that raises, hangs or returns a non-finite value gets the fallback and is counted
per iteration; above ``--reward_max_failure_rate`` the run stops with the first error),
``--remote_rm_url`` (HTTP), and/or ``--reward_pretrain`` (a reward model role). Every
run prints the batch arithmetic and where each role runs. ``--eval_dataset`` adds the loop's
eval pass (:mod:`rl_core.trainers.ppo_eval`): the eval set is read here, with the prompts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import logging
import sys
from dataclasses import replace

from rl_cli import extensions
from rl_cli.config import build_parser
from rl_cli.errors import CliArgs, UserError, set_debug, user_errors
from rl_cli.loading import build, given, settings
from rl_cli.placement_args import RayArgs, _world_sizes, check_role_placement
from rl_cli.train import _local_models, _wandb_installed, _wandb_key, check_moe
from rl_core.configs import check_eval_rows, check_eval_set
from rl_core.data.config import DataConfig
from rl_core.data.loading import DataError, load_rows
from rl_core.folder_lock import hold
from rl_core.metrics import LoggerConfig, MetricsLogger
from rl_core.rl.batching_config import MicroBatchConfig
from rl_core.rl.model_config import RLModelConfig
from rl_core.rl.roles import require_reward
from rl_core.strategy_config import StrategyConfig
from rl_core.trainers.ppo_checks import check_combinations
from rl_core.trainers.ppo_config import PPOConfig
from rl_rollout.config import EngineConfig, RewardConfig, WeightSyncConfig
from rl_rollout.rewards import RewardError

logger = logging.getLogger(__name__)


def _groups(ray: bool) -> dict[str, type]:
    g = {
        "model": RLModelConfig,
        "data": DataConfig,
        "strategy": StrategyConfig,
        "ppo": PPOConfig,
        "reward": RewardConfig,
        "rollout": EngineConfig,
        "sync": WeightSyncConfig,
        "batching": MicroBatchConfig,
        "logger": LoggerConfig,
        "cli": CliArgs,
    }
    if ray:
        g["ray"] = RayArgs
    return g


# Flags of the shared groups that an RL run would not use: refused, with the reason, instead of ignored.
UNUSED_BY_RL = {
    "output_key": "the RL loop generates the responses: only --input_key (and --label_key) are read",
    "chosen_key": "preference keys are for rl dpo / rl rm / rl kto, not the RL loop",
    "rejected_key": "preference keys are for rl dpo / rl rm / rl kto, not the RL loop",
    "prompt_key": "preference keys are for rl dpo / rl rm / rl kto, not the RL loop",
    "margin_key": "preference keys are for rl dpo / rl rm / rl kto, not the RL loop",
    "desirable_key": "preference keys are for rl dpo / rl rm / rl kto, not the RL loop",
}


def _refuse_unused(cfgs: dict, parser) -> None:
    d = cfgs["data"]
    defaults = DataConfig()
    for name, why in UNUSED_BY_RL.items():
        if hasattr(d, name) and getattr(d, name) != getattr(defaults, name):
            parser.error(f"--{name}: {why}; drop the flag")


def _auto(cfgs: dict, given: frozenset[str], ray: bool) -> tuple:
    """Decide the settings left to the hardware (rl_core.rl.auto) into ``cfgs``; the choices, with why."""
    # lazy: rl_core.rl.auto imports torch (the device); only a run or --print_config decides
    from rl_core.rl.auto import Hardware
    from rl_core.rl.auto import resolve as resolve_auto

    sizes = _world_sizes(cfgs) if ray else {"policy": 1}
    hw = Hardware.here(trained_ranks=max(sizes.get("policy", 1), sizes.get("critic", 0)))
    rc, chosen = resolve_auto(run_config(cfgs), hw, given=given, images=cfgs["data"].image_key is not None)
    cfgs.update(
        model=rc.model,
        strategy=rc.strategy,
        batching=rc.batching,
        data=dataclasses.replace(cfgs["data"], packing=rc.packing),
    )
    return chosen


def _prepare(name: str, argv: list[str] | None, ray: bool):
    argv = sys.argv[1:] if argv is None else argv
    groups = _groups(ray)
    extensions.load(extensions.in_argv(argv))  # before the parser: --help lists what they register
    parser, flags = build_parser(f"rl {name}", f"rl {name}: {__doc__.splitlines()[0]}", groups)
    args = parser.parse_args(_wandb_key(argv, parser))
    try:
        values = settings(groups, args, flags)
        extensions.load(values.get("cli.extension", ()))  # a --config file's, before the settings
        cfgs = build(groups, values, flags)
        run_config(cfgs)  # its cross-checks (DeepSpeed sleep, frozen-model offload) before anything loads
    except (ValueError, FileNotFoundError) as e:
        parser.error(str(e))
    p, ring = cfgs["ppo"], cfgs["strategy"].ring_attn_size
    if ring > 1 and not ray:
        parser.error(
            f"--ring_attn_size {ring} splits each packed row over {ring} ranks of a role; rl ppo runs every "
            f"role as one process: use rl ppo-ray with --actor_num_gpus_per_node a multiple of {ring}"
        )
    ck = p.ckpt
    if ck.save_hf_ckpt and ck.save_steps <= 0:  # OpenRLHF's run then writes no checkpoint to put an export in either
        print(
            f"[rl {name}] --ckpt.save_hf: no checkpoints are written without --ckpt.save_steps; the final model "
            f"goes to --save_path ({ck.save_path or 'not set: the run saves nothing'})",
            flush=True,
        )
    if getattr(args, "print_config", False):  # a dry run: before any path is read, model loaded or Ray started
        if ray:  # a placement flag of a role the run lacks is refused by the dry run as by the run
            try:
                check_role_placement(cfgs["ray"], p, cfgs["model"])
            except ValueError as e:
                parser.error(str(e))
        # lazy: rl_core.preflight reads the hub's cache (huggingface_hub); only --print_config prints
        from rl_cli.dry_run import print_config

        print_config(name, cfgs, chosen=_auto(cfgs, given(groups, args, flags), ray))
        return None
    m, d, p = cfgs["model"], cfgs["data"], cfgs["ppo"]
    if not m.pretrain:
        parser.error("--pretrain is required: a local HF model folder (config.json, weights, tokenizer)")
    if not d.dataset:
        parser.error("--prompt_data (or --dataset) is required: prompts as .jsonl/.json/.parquet or a datasets folder")

    try:
        require_reward(
            reward_fn=cfgs["reward"].given,
            reward_model=bool(m.reward_pretrain),
            agent=bool(p.agent or p.agent_cmd),
            distill_only=bool(p.distill and p.distill.only),
        )
        if ray:
            check_role_placement(cfgs["ray"], p, m)
        check_eval_set(p.eval.steps, bool(d.eval_dataset))
        check_combinations(p, eval_set=bool(d.eval_dataset), sleep_engines=cfgs["rollout"].enable_sleep)
        if p.async_rl:  # keep mode on the HF engine, known from --rollout_engine before any model loads
            p.async_rl.check_engine(cfgs["rollout"].kind)
    except ValueError as e:
        parser.error(str(e))
    _refuse_unused(cfgs, parser)
    cfgs["model"] = m = _local_models(f"rl {name}", m)  # hub ids -> local HF cache folders, before any model loads
    _wandb_installed(f"rl {name}", cfgs["logger"])
    set_debug(cfgs["cli"].debug)

    # lazy: the hub (huggingface_hub), transformers' tokenizers and rl-core's datasets (torch): after the parse
    from rl_core.data import PromptDataset, training_rows
    from rl_core.preflight import (
        check_model,
        check_models,
        check_reward_head,
        check_rl_batches,
        check_teacher_tokenizer,
        load_processor,
        load_tokenizer,
    )

    cfgs["model"] = m = check_models(m)  # config.json and weights in every model folder
    if m.reward_pretrain:  # a folder without a score head would score noise: refused here, not inside a worker
        check_reward_head(m.reward_pretrain, value_head_prefix=m.value_head_prefix)
    if p.distill is not None:  # the teacher's folder and tokenizer, before any model loads
        teacher = check_model(p.distill.teacher_pretrain, flag="--teacher_pretrain")
        check_teacher_tokenizer(m.pretrain, teacher)
        cfgs["ppo"] = p = dataclasses.replace(p, distill=dataclasses.replace(p.distill, teacher_pretrain=teacher))
    for choice in _auto(cfgs, given(groups, args, flags), ray):  # the hardware's settings, from the local folders
        print(f"[rl {name}] auto: {choice}", flush=True)
    check_moe(p.policy_loss.aux_loss_coef, m.pretrain)
    try:
        cfgs["reward"].check(label_key=d.label_key)
    except ValueError as e:
        raise UserError(str(e)) from e
    if not ray:
        try:
            cfgs["sync"].check(in_process=True)
        except ValueError as e:
            parser.error(str(e))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    if not getattr(args, "print_config", False):
        cfgs["reward"].check_sources()  # the reward file imports, the reward server answers

    tok = load_tokenizer(m.pretrain, use_fast=not d.disable_fast_tokenizer, chat_template=d.tokenizer_chat_template)
    proc = load_processor(m.pretrain) if d.image_key else None  # vision-language prompts
    if proc is not None and cfgs["rollout"].spec().name == "vllm":
        if importlib.util.find_spec("torchvision") is None:  # vLLM's multimodal models import it: fail before loading
            raise UserError(
                "prompts with images (--image_key) on vLLM engines need torchvision (vLLM's multimodal "
                "models import it), which is not installed: install the torchvision built for your "
                "torch, or add --rollout_engine hf (the transformers engine generates from the images)"
            )
    prompts = PromptDataset(training_rows(d, cfgs["strategy"].seed), tok, d, processor=proc)
    eval_prompts = None
    if d.eval_dataset:
        try:
            eval_prompts = PromptDataset(
                load_rows(d.eval_dataset, d.eval_split, d.max_eval_samples, skip_bad=d.skip_bad_rows),
                tok,
                d,
                processor=proc,
            )
        except DataError as e:  # say which of the two sets is bad
            raise type(e)(f"eval set (--eval_dataset {d.eval_dataset}): {e}") from None
        try:
            check_eval_rows(len(eval_prompts), d.eval_dataset)
        except ValueError as err:
            raise UserError(str(err)) from None
        ev = p.eval  # not `e`: that name is the except clause's above
        when = f"every {ev.steps} iterations and " if ev.steps > 0 else ""
        print(
            f"[rl {name}] eval: {len(eval_prompts)} prompts x {ev.n_samples_per_prompt} samples at "
            f"temperature {ev.temperature}, {when}after the last iteration",
            flush=True,
        )
    s = cfgs["strategy"]
    samples = p.rollout_batch_size * p.sampling.n_samples_per_prompt
    steps = p.optimizer_steps(len(prompts), s.train_batch_size) if samples % s.train_batch_size == 0 else 1
    print(f"[rl {name}] {prompts.report.summary()}")
    print(
        f"[rl {name}] {p.iterations(len(prompts))} iterations x {p.rollout_batch_size} prompts x "
        f"{p.sampling.n_samples_per_prompt} samples = {samples} samples each; train_batch_size {s.train_batch_size}, "
        f"micro {s.micro_train_batch_size}, {p.max_epochs} epoch(s) -> {steps} optimizer steps per model; "
        f"estimator {p.advantage.estimator}{', critic' if p.needs_critic else ''}, loss {p.policy_loss.type}"
        f"{', reference (kl ' + str(p.kl.init_coef) + (' loss' if p.kl.use_loss else ' penalty') + ')' if p.needs_reference else ''}",
        flush=True,
    )
    check_rl_batches(p, s, len(prompts), _world_sizes(cfgs) if ray else None)  # before any model loads
    return cfgs, tok, prompts, eval_prompts


def pretrain_items(cfgs: dict, tok, n_prompts: int):
    """PPO-ptx's pretraining rows (--pretrain_data) through the prompts' loaders, as a PretrainDataset; None
    without the flag. As OpenRLHF: at most max_epochs x prompts x n_samples_per_prompt rows, cut at the prompt
    plus the response length."""
    p, d = cfgs["ppo"], cfgs["data"]
    if p.ptx is None:
        return None
    # lazy: rl-core's datasets import torch; only a run with --pretrain_data reads them
    from rl_core.data import PretrainDataset, training_rows

    cfg = replace(
        d,
        dataset=p.ptx.data,
        dataset_probs=p.ptx.data_probs,
        split=p.ptx.split,
        max_len=d.max_len + p.sampling.max_new_tokens,
        max_samples=p.max_epochs * n_prompts * p.sampling.n_samples_per_prompt,
        apply_chat_template=False,
        tokenizer_chat_template=None,
        input_template=None,
        image_key=None,
        eval_dataset=None,
        packing=False,
    )
    try:
        return PretrainDataset(training_rows(cfg, cfgs["strategy"].seed), tok, cfg)
    except DataError as e:  # say which set is bad
        raise type(e)(f"pretraining set (--pretrain_data {p.ptx.data}): {e}") from None


def run_config(cfgs: dict):
    # lazy: rl_core.rl.build imports torch, the models and the loop; the flags are parsed without them
    from rl_core.rl.build import RunConfig

    return RunConfig(
        model=cfgs["model"],
        strategy=cfgs["strategy"],
        ppo=cfgs["ppo"],
        engine=cfgs["rollout"],
        sync=cfgs["sync"],
        batching=cfgs["batching"],
        packing=cfgs["data"].packing,
    )


def metrics_logger(cfgs: dict):
    """The driver's metrics: run_dir files, TensorBoard (--use_tensorboard), wandb (--use_wandb) and MLflow
    (--use_mlflow) with the run's settings as their config (minus tokens)."""

    run_config = (
        {
            g: {k: v for k, v in dataclasses.asdict(c).items() if "token" not in k}
            for g, c in cfgs.items()
            if g != "logger"
        }
        if cfgs["logger"].use_wandb or cfgs["logger"].mlflow is not None
        else None
    )
    return MetricsLogger.from_config(cfgs["ppo"].run_dir, cfgs["logger"], run_config=run_config)


def _finish(name: str, trainer, cfgs) -> int:
    h = trainer.history
    if h:
        k = max(1, len(h) // 5)
        first = sum(x["reward_mean"] for x in h[:k]) / k
        last = sum(x["reward_mean"] for x in h[-k:]) / k
        p = cfgs["ppo"]
        where = {
            f: v
            for f, v in (("save_path", p.ckpt.save_path), ("ckpt_path", p.ckpt.ckpt_path), ("run_dir", p.run_dir))
            if v
        }
        print(
            f"[rl {name}] done: {len(h)} iterations, reward {first:.3f} (first {k}) -> {last:.3f} (last {k}); {where}",
            flush=True,
        )
    if trainer.eval_history:
        e = trainer.eval_history[-1]
        shown = ", ".join(f"{k[len('eval/') :]} {v:.4g}" for k, v in e.items() if k.startswith("eval/"))
        print(f"[rl {name}] eval at iteration {e['iteration']}: {shown}", flush=True)
    return 0


# ----- rl ppo ---------------------------------------------------------------------------------


@contextlib.contextmanager
def run_folders(cfgs: dict):
    """Lock the folders the run writes (``--run_dir``, ``--ckpt_path``, ``--save_path``: rl_core.folder_lock) for its
    life, then
    decide what resume takes (rl_core.trainers.ppo_checkpoint.check_folder: damaged checkpoints skipped, a folder
    that cannot serve refused), all before any model loads."""

    # lazy: rl-core's checkpoints import torch; a run reaches them, --help does not
    from rl_core.trainers.ppo_checkpoint import check_folder

    ck = cfgs["ppo"].ckpt
    with hold({"--run_dir": cfgs["ppo"].run_dir, "--ckpt_path": ck.ckpt_path}, {"--save_path": ck.save_path}):
        check_folder(ck)
        yield


@user_errors("rl ppo")
def run_local(argv: list[str] | None = None) -> int:
    prepared = _prepare("ppo", argv, ray=False)
    if prepared is None:
        return 0
    cfgs, tok, prompts, eval_prompts = prepared
    # lazy: the builder imports torch, DeepSpeed, the models and the loop; rl ppo --help does not
    from rl_core.rl.build import LocalFactory, build_run

    with run_folders(cfgs):  # before any model loads: a folder another run writes is refused at once
        run = build_run(
            run_config(cfgs),
            LocalFactory(),
            prompts=prompts,
            tokenizer=tok,
            reward_fn=cfgs["reward"].build(),
            metrics=metrics_logger(cfgs),
            eval_prompts=eval_prompts,
            ptx=pretrain_items(cfgs, tok, len(prompts)),
        )
        print(
            f"[rl ppo] one process: {run.roles()} on {run.policy.call_rank(0, 'world')['device']}; rollout "
            f"{type(run.rollout).__name__}",
            flush=True,
        )
        try:
            run.trainer.fit()
        except RewardError as e:  # more reward calls failed than --reward_max_failure_rate tolerates
            raise SystemExit(f"rl ppo: {e}") from None
        finally:
            run.close()
    return _finish("ppo", run.trainer, cfgs)
