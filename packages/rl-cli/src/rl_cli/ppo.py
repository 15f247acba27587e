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

Rewards: ``--reward_fn`` (``file.py:func``, ``module:func``, ``builtin:math`` ...)
run by a :class:`rl_rollout.RewardRunner` (a raising or hanging function becomes a
counted fallback), ``--remote_rm_url`` (HTTP), and/or ``--reward_pretrain`` (a reward
model role). Every run prints the batch arithmetic and where each role runs.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from dataclasses import dataclass

from rl_cli.config import build_parser, describe, resolve

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RLModelArgs:
    """The RL run's model folders (OpenRLHF flag names)."""

    pretrain: str | None = None  # --pretrain: the policy to train (local HF folder)
    critic_pretrain: str | None = None  # --critic_pretrain: critic init for gae (default: --reward_pretrain, else --pretrain)
    reward_pretrain: str | None = None  # --reward_pretrain: a reward model folder (rl rm's output)
    ref_pretrain: str | None = None  # --ref_pretrain: reference policy (default: --pretrain)
    flash_attn: bool = False  # --flash_attn: flash_attention_2 (needs flash-attn; default sdpa)
    normalize_reward: bool = True  # --normalize_reward: apply the reward model's stored mean/std


@dataclass(frozen=True)
class RewardArgs:
    """Reward functions and remote reward models."""

    reward_fn: str | None = None  # --reward_fn: file.py:func | module:func | builtin:exact_match | builtin:math | builtin:format:REGEX
    remote_rm_url: str | None = None  # --remote_rm_url: an HTTP reward server (rl_rollout.RewardServer protocol)
    remote_rm_token: str | None = None  # bearer token for --remote_rm_url (default: env RL_REWARD_TOKEN)
    reward_workers: int = 0  # processes scoring --reward_fn (0: in this process)
    reward_timeout: float | None = 30.0  # seconds per call before the fallback (needs reward_workers > 0)
    reward_fallback: float = 0.0  # reward of a call that raised or timed out (counted in the metrics)


@dataclass(frozen=True)
class RolloutArgs:
    """The rollout engines."""

    rollout_engine: str = "auto"  # auto (vLLM when usable) | vllm | hf
    vllm_gpu_memory_utilization: float = 0.5  # --vllm_gpu_memory_utilization
    enforce_eager: bool = False  # --enforce_eager: no CUDA graphs in vLLM
    vllm_enable_sleep: bool = False  # --vllm_enable_sleep: engines sleep while the models train
    vllm_sync_backend: str = "auto"  # --vllm_sync_backend: nccl | gloo | ipc | auto (GPUs: nccl; hybrid engine: ipc)
    max_batch_sequences: int = 256  # HF engine: sequences per generate call


@dataclass(frozen=True)
class RayArgs:
    """Placement (OpenRLHF names); a role's counts default to the actor's when the run needs it."""

    actor_num_nodes: int = 1  # --actor_num_nodes
    actor_num_gpus_per_node: int = 1  # --actor_num_gpus_per_node
    critic_num_nodes: int | None = None  # --critic_num_nodes
    critic_num_gpus_per_node: int | None = None  # --critic_num_gpus_per_node
    ref_num_nodes: int | None = None  # --ref_num_nodes
    ref_num_gpus_per_node: int | None = None  # --ref_num_gpus_per_node
    reward_num_nodes: int | None = None  # --reward_num_nodes
    reward_num_gpus_per_node: int | None = None  # --reward_num_gpus_per_node
    vllm_num_engines: int = 1  # --vllm_num_engines
    vllm_tensor_parallel_size: int = 1  # --vllm_tensor_parallel_size
    colocate_actor_ref: bool = False  # --colocate_actor_ref
    colocate_critic_reward: bool = False  # --colocate_critic_reward
    colocate_all_models: bool = False  # --colocate_all_models: the hybrid engine (every model with the engines)
    ray_address: str | None = None  # an existing cluster (default: RAY_ADDRESS, else a local Ray)
    num_gpus: int | None = None  # a local Ray's logical GPUs (for machines without GPUs; tests, dry runs)
    placement_strategy: str = "PACK"  # PACK | SPREAD for the model groups
    call_timeout_s: float = 3600.0  # a role call that takes longer fails, naming the role and rank


def _groups(ray: bool) -> dict[str, type]:
    from rl_core.data import DataConfig
    from rl_core.strategy import StrategyConfig
    from rl_core.trainers.ppo import PPOConfig

    g = {"model": RLModelArgs, "data": DataConfig, "strategy": StrategyConfig, "ppo": PPOConfig,
         "reward": RewardArgs, "rollout": RolloutArgs}
    if ray:
        g["ray"] = RayArgs
    return g


# ----- what both commands build ---------------------------------------------------------------


def _reward_fn(r: RewardArgs):
    import os

    fns = []
    if r.reward_fn:
        from rl_rollout import RewardRunner

        fns.append(RewardRunner(r.reward_fn, workers=r.reward_workers,
                                timeout_s=r.reward_timeout if r.reward_workers else None, fallback=r.reward_fallback))
    if r.remote_rm_url:
        from rl_rollout import RemoteRewardClient

        fns.append(RemoteRewardClient(r.remote_rm_url, token=r.remote_rm_token or os.environ.get("RL_REWARD_TOKEN")))
    if not fns:
        return None
    if len(fns) == 1:
        return fns[0]
    return _SummedRewards(fns)


class _SummedRewards:
    def __init__(self, fns):
        self.fns = fns

    def score(self, prompts, responses, labels):
        parts = [f.score(prompts, responses, labels) for f in self.fns]
        return [sum(x) for x in zip(*parts, strict=True)]


def _load_kw(m: RLModelArgs, s) -> dict:
    return {"dtype": "bf16" if s.bf16 else "fp32",
            "attn_implementation": "flash_attention_2" if m.flash_attn else None,
            "gradient_checkpointing": s.gradient_checkpointing}


def _critic_path(m: RLModelArgs) -> str:
    return m.critic_pretrain or m.reward_pretrain or m.pretrain


def _prepare(name: str, argv: list[str] | None, ray: bool):
    groups = _groups(ray)
    parser, flags = build_parser(f"rl {name}", f"rl {name}: {__doc__.splitlines()[0]}", groups)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        cfgs = resolve(groups, args, flags)
    except (ValueError, FileNotFoundError) as e:
        parser.error(str(e))
    m, d, p = cfgs["model"], cfgs["data"], cfgs["ppo"]
    if not m.pretrain:
        parser.error("--pretrain is required: a local HF model folder (config.json, weights, tokenizer)")
    if not d.dataset:
        parser.error("--prompt_data (or --dataset) is required: prompts as .jsonl/.json/.parquet or a datasets folder")
    if not (cfgs["reward"].reward_fn or cfgs["reward"].remote_rm_url or m.reward_pretrain):
        parser.error("no reward: give --reward_fn SPEC (file.py:func, builtin:math ...), --remote_rm_url URL "
                     "or --reward_pretrain FOLDER")
    if cfgs["rollout"].rollout_engine not in ("auto", "vllm", "hf"):
        parser.error(f"--rollout_engine must be auto, vllm or hf, got {cfgs['rollout'].rollout_engine!r}")
    if cfgs["rollout"].vllm_sync_backend not in ("auto", "nccl", "gloo", "ipc"):
        parser.error(f"--vllm_sync_backend must be auto, nccl, gloo or ipc, got {cfgs['rollout'].vllm_sync_backend!r}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from transformers import AutoTokenizer

    from rl_core.data import PromptDataset, load_rows

    tok = AutoTokenizer.from_pretrained(m.pretrain)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    prompts = PromptDataset(load_rows(d.dataset, d.split, d.max_samples), tok, d)
    s = cfgs["strategy"]
    samples = p.rollout_batch_size * p.n_samples_per_prompt
    steps = p.optimizer_steps(len(prompts), s.train_batch_size) if samples % s.train_batch_size == 0 else 1
    print(f"[rl {name}] {prompts.report.summary()}")
    print(f"[rl {name}] {p.iterations(len(prompts))} iterations x {p.rollout_batch_size} prompts x "
          f"{p.n_samples_per_prompt} samples = {samples} samples each; train_batch_size {s.train_batch_size}, "
          f"micro {s.micro_train_batch_size}, {p.max_epochs} epoch(s) -> {steps} optimizer steps per model; "
          f"estimator {p.advantage_estimator}{', critic' if p.needs_critic else ''}"
          f"{', reference (kl ' + str(p.init_kl_coef) + (' loss' if p.use_kl_loss else ' penalty') + ')' if p.needs_reference else ''}",
          flush=True)
    if getattr(args, "print_config", False):
        print(describe(cfgs))
        return None
    return cfgs, tok, prompts, steps


def _finish(name: str, trainer, cfgs) -> int:
    h = trainer.history
    if h:
        k = max(1, len(h) // 5)
        first = sum(x["reward_mean"] for x in h[:k]) / k
        last = sum(x["reward_mean"] for x in h[-k:]) / k
        where = {f: v for f, v in dataclasses.asdict(cfgs["ppo"]).items()
                 if f in ("save_path", "ckpt_path", "run_dir") and v}
        print(f"[rl {name}] done: {len(h)} iterations, reward {first:.3f} (first {k}) -> {last:.3f} (last {k}); "
              f"{where}", flush=True)
    return 0


# ----- rl ppo ---------------------------------------------------------------------------------


def run_local(argv: list[str] | None = None) -> int:
    prepared = _prepare("ppo", argv, ray=False)
    if prepared is None:
        return 0
    cfgs, tok, prompts, steps = prepared
    m, s, p, r = cfgs["model"], cfgs["strategy"], cfgs["ppo"], cfgs["rollout"]

    from rl_core.rl import CriticWorker, DirectWeightSync, LocalGroup, PolicyWorker, ReferenceWorker, RewardModelWorker
    from rl_core.trainers.ppo import PPOTrainer
    from rl_rollout import make_engine

    kw, pad = _load_kw(m, s), tok.pad_token_id
    policy = LocalGroup(PolicyWorker(s, m.pretrain, p, steps, load_kw=kw, pad_id=pad, ckpt_path=p.ckpt_path), "policy")
    critic = LocalGroup(CriticWorker(s, _critic_path(m), p, steps, load_kw=kw, pad_id=pad, ckpt_path=p.ckpt_path),
                        "critic") if p.needs_critic else None
    ref = LocalGroup(ReferenceWorker(s, m.ref_pretrain or m.pretrain, load_kw=kw, pad_id=pad),
                     "ref") if p.needs_reference else None
    rm = LocalGroup(RewardModelWorker(s, m.reward_pretrain, load_kw=kw, pad_id=pad, normalize=m.normalize_reward),
                    "reward") if m.reward_pretrain else None
    engine = make_engine(r.rollout_engine, m.pretrain, hf_options={
        "device": str(policy.worker.s.device), "dtype": "bfloat16" if s.bf16 else "float32",
        "max_batch_sequences": r.max_batch_sequences},
        vllm_options={"seed": s.seed, "enforce_eager": r.enforce_eager, "in_process": True,
                      "engine_kwargs": {"gpu_memory_utilization": r.vllm_gpu_memory_utilization}})
    print(f"[rl ppo] one process: policy{', critic' if critic else ''}{', ref' if ref else ''}"
          f"{', reward model' if rm else ''} on {policy.worker.s.device}; rollout {type(engine).__name__}", flush=True)
    reward = _reward_fn(cfgs["reward"])
    trainer = PPOTrainer(p, policy=policy, rollout=engine, weight_sync=DirectWeightSync(policy, engine),
                         prompts=prompts, tokenizer=tok, train_batch_size=s.train_batch_size, reward_fn=reward,
                         reward_model=rm, critic=critic, ref=ref, sleep_engines=r.vllm_enable_sleep, seed=s.seed)
    try:
        trainer.fit()
    finally:
        if reward is not None and hasattr(reward, "close"):
            reward.close()
        engine.shutdown()
    return _finish("ppo", trainer, cfgs)


# ----- rl ppo-ray -----------------------------------------------------------------------------


def plan_from(ray_args: RayArgs, ppo, model: RLModelArgs):
    """The placement plan: roles the run needs (critic for gae, ref for KL, reward for a reward model)."""
    from rl_placement import PlacementPlan

    a = ray_args

    def counts(prefix: str, needed: bool):
        nodes, gpus = getattr(a, f"{prefix}_num_nodes"), getattr(a, f"{prefix}_num_gpus_per_node")
        if not needed:
            return 0, 0
        return (a.actor_num_nodes if nodes is None else nodes), (a.actor_num_gpus_per_node if gpus is None else gpus)

    critic = counts("critic", ppo.needs_critic)
    ref = counts("ref", ppo.needs_reference)
    reward = counts("reward", bool(model.reward_pretrain))
    return PlacementPlan.from_flags(
        actor_num_nodes=a.actor_num_nodes, actor_num_gpus_per_node=a.actor_num_gpus_per_node,
        critic_num_nodes=critic[0], critic_num_gpus_per_node=critic[1], ref_num_nodes=ref[0],
        ref_num_gpus_per_node=ref[1], reward_num_nodes=reward[0], reward_num_gpus_per_node=reward[1],
        vllm_num_engines=a.vllm_num_engines, vllm_tensor_parallel_size=a.vllm_tensor_parallel_size,
        colocate_actor_ref=a.colocate_actor_ref, colocate_critic_reward=a.colocate_critic_reward,
        colocate_all_models=a.colocate_all_models)


def _local_ray_env() -> None:
    """A local Ray's workers share this process's venv: no per-worker rebuild, bytecode kept.

    Under ``uv run``, Ray 2.45+ would otherwise rebuild the whole workspace into every
    worker's environment (its uv hook: minutes per run on 2 cores); and with
    PYTHONDONTWRITEBYTECODE every worker compiles Ray from source.
    """
    import os
    import tempfile

    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    os.environ.setdefault("PYTHONPYCACHEPREFIX", os.path.join(tempfile.gettempdir(), "rl-ray-pycache"))
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    try:
        import ray._private.ray_constants as ray_constants

        ray_constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV = os.environ["RAY_ENABLE_UV_RUN_RUNTIME_ENV"] not in ("0", "false")
    except (ImportError, AttributeError):
        pass


def run_ray(argv: list[str] | None = None) -> int:
    prepared = _prepare("ppo-ray", argv, ray=True)
    if prepared is None:
        return 0
    cfgs, tok, prompts, steps = prepared
    m, s, p, r, a = cfgs["model"], cfgs["strategy"], cfgs["ppo"], cfgs["rollout"], cfgs["ray"]
    from rl_placement import PlacementError

    try:
        plan = plan_from(a, p, m)  # validated in pure Python before Ray starts
    except PlacementError as e:
        raise SystemExit(f"rl ppo-ray: the placement cannot work: {e}") from None
    print(f"[rl ppo-ray] placement:\n{plan.describe()}", flush=True)
    tp = a.vllm_tensor_parallel_size
    if tp > 1 and r.rollout_engine == "hf":
        raise SystemExit(f"rl ppo-ray: --vllm_tensor_parallel_size {tp} shards each engine over {tp} GPUs, which "
                         f"the HF engine cannot: use --rollout_engine vllm (or auto), or tensor parallel 1")
    if r.vllm_sync_backend == "ipc" and not (a.colocate_all_models and tp == 1):
        raise SystemExit("rl ppo-ray: --vllm_sync_backend ipc reads the weights in place on the GPU an actor rank "
                         "shares with its engine: it needs --colocate_all_models (the hybrid engine) with "
                         "--vllm_tensor_parallel_size 1; use nccl or gloo otherwise")

    import os

    import ray

    from rl_cli import ray_workers as rw
    from rl_cli.ray_engines import engine_gpus, start_engines
    from rl_core.rl import BroadcastWeightSync, GroupRollout, IpcWeightSync
    from rl_core.trainers.ppo import PPOTrainer
    from rl_placement import RayActorGroup, create_placement_groups

    address = a.ray_address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, include_dashboard=False)
    else:
        _local_ray_env()
        ray.init(num_gpus=a.num_gpus, include_dashboard=False, log_to_driver=True)
    groups: list = []
    placed = None
    reward = None
    try:
        try:
            placed = create_placement_groups(plan, strategy=a.placement_strategy)
        except PlacementError as e:
            raise SystemExit(f"rl ppo-ray: the placement does not fit this cluster: {e}") from None
        gpus = engine_gpus(placed)  # TP > 1 engines' GPU ids, read before any actor fills the bundles
        kw, pad = _load_kw(m, s), tok.pad_token_id
        opts = {"call_timeout_s": a.call_timeout_s}

        def role(cls, name, *init_args, **init_kwargs):
            g = RayActorGroup.from_plan(cls, placed, name, init_args=init_args, init_kwargs=init_kwargs, **opts)
            groups.append(g)
            return g

        policy = role(rw.RayPolicyWorker, "actor", s, m.pretrain, p, steps, load_kw=kw, pad_id=pad,
                      ckpt_path=p.ckpt_path)
        critic = role(rw.RayCriticWorker, "critic", s, _critic_path(m), p, steps, load_kw=kw, pad_id=pad,
                      ckpt_path=p.ckpt_path) if plan.critic else None
        ref = role(rw.RayReferenceWorker, "ref", s, m.ref_pretrain or m.pretrain, load_kw=kw,
                   pad_id=pad) if plan.ref else None
        rm = role(rw.RayRewardModelWorker, "reward", s, m.reward_pretrain, load_kw=kw, pad_id=pad,
                  normalize=m.normalize_reward) if plan.reward else None
        engines = start_engines(
            placed, r.rollout_engine, m.pretrain, gpus=gpus, seed=s.seed, call_timeout_s=a.call_timeout_s,
            hf_options={"dtype": "bfloat16" if s.bf16 else "float32", "max_batch_sequences": r.max_batch_sequences},
            vllm_options={"enforce_eager": r.enforce_eager, "enable_sleep_mode": r.vllm_enable_sleep,
                          "engine_kwargs": {"gpu_memory_utilization": r.vllm_gpu_memory_utilization}})
        groups.extend(engines)
        device = policy.call_rank(0, "world")["device"]
        backend = r.vllm_sync_backend
        if backend == "auto":  # colocated on GPUs: NCCL refuses two ranks on one GPU, IPC reads in place
            backend = (("ipc" if tp == 1 else "gloo") if a.colocate_all_models else "nccl") \
                if device.startswith("cuda") else "gloo"
        if backend == "ipc" and not device.startswith("cuda"):
            raise SystemExit(f"rl ppo-ray: --vllm_sync_backend ipc shares CUDA memory, but the policy runs on "
                             f"{device}: use gloo (or auto) on a machine without GPUs")
        e0 = engines[0].call_rank(0, "describe")
        print(f"[rl ppo-ray] {len(groups)} actor groups up; policy on {device} x {policy.world_size}; "
              f"{len(engines)} engine(s) {e0['kind']} TP {e0['tensor_parallel_size']}"
              f"{' on GPUs ' + ','.join(e0['visible_devices']) if e0['visible_devices'] else ''}; "
              f"weight sync {backend}", flush=True)
        rollout = GroupRollout(engines)
        if backend == "ipc":
            sync = IpcWeightSync(policy, rollout, verify=p.verify_weights)
        else:
            sync = BroadcastWeightSync(policy, rollout, backend=backend, engine_workers=[tp] * len(engines),
                                       verify=p.verify_weights)
        reward = _reward_fn(cfgs["reward"])
        trainer = PPOTrainer(p, policy=policy, rollout=rollout, weight_sync=sync, prompts=prompts, tokenizer=tok,
                             train_batch_size=s.train_batch_size, reward_fn=reward, reward_model=rm, critic=critic,
                             ref=ref, sleep_engines=r.vllm_enable_sleep, seed=s.seed)
        trainer.fit()
        return _finish("ppo-ray", trainer, cfgs)
    finally:
        if reward is not None and hasattr(reward, "close"):
            reward.close()
        for g in reversed(groups):
            g.shutdown()
        if placed is not None:
            placed.remove()
        ray.shutdown()
