"""``rl ppo-ray``: the RL loop of :mod:`rl_cli.ppo` with one Ray actor per rank of each role and engine actors,
placed by the plan of :mod:`rl_cli.placement_args` (validated before Ray starts), on a cluster found or a
local Ray started here (``--num_gpus N`` logical GPUs on a machine without any)."""

from __future__ import annotations

import os
import tempfile

from rl_cli import extensions
from rl_cli.errors import user_errors
from rl_cli.placement_args import plan_from
from rl_cli.ppo import _finish, _prepare, metrics_logger, pretrain_items, run_config, run_folders
from rl_cli.ray_cluster import cluster_address, connect
from rl_rollout import engine_spec
from rl_rollout.rewards import RewardError

# OpenRLHF's --full_determinism for its vLLM engines (vllm_engine.py, after vLLM's reproducibility example): the
# engine core runs in the engine's process, so its scheduling does not race a second process
DETERMINISTIC_VLLM_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def _local_ray_env() -> None:
    """A local Ray's workers share this process's venv: no per-worker rebuild, bytecode kept.

    Under ``uv run``, Ray 2.45+ would otherwise rebuild the whole workspace into every
    worker's environment (its uv hook: minutes per run on 2 cores); and with
    PYTHONDONTWRITEBYTECODE every worker compiles Ray from source.
    """

    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    os.environ.setdefault("PYTHONPYCACHEPREFIX", os.path.join(tempfile.gettempdir(), "rl-ray-pycache"))
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    try:
        import ray._private.ray_constants as ray_constants

        ray_constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV = os.environ["RAY_ENABLE_UV_RUN_RUNTIME_ENV"] not in ("0", "false")
    except (ImportError, AttributeError):
        pass


@user_errors("rl ppo-ray")
def run_ray(argv: list[str] | None = None) -> int:
    prepared = _prepare("ppo-ray", argv, ray=True)
    if prepared is None:
        return 0
    cfgs, tok, prompts, eval_prompts = prepared
    p, r, a = cfgs["ppo"], cfgs["rollout"], cfgs["ray"]
    # lazy: rl-placement imports ray; `rl ppo-ray --help` stays light
    from rl_placement import PlacementError

    try:
        plan = plan_from(a, p, cfgs["model"])  # validated in pure Python before Ray starts
    except PlacementError as e:
        raise SystemExit(f"rl ppo-ray: the placement cannot work: {e}") from None
    print(f"[rl ppo-ray] placement:\n{plan.describe()}", flush=True)
    tp = a.vllm_tensor_parallel_size
    if tp > 1 and r.kind != "auto" and not engine_spec(r.kind).tensor_parallel:
        raise SystemExit(
            f"rl ppo-ray: --vllm_tensor_parallel_size {tp} shards each engine over {tp} GPUs, which "
            f"the {r.kind} engine cannot: use --rollout_engine vllm (or auto), or tensor parallel 1"
        )
    try:
        cfgs["sync"].check(in_process=False, colocated=a.colocate_all_models, tensor_parallel_size=tp)
    except ValueError as e:
        raise SystemExit(f"rl ppo-ray: {e}") from None
    with run_folders(cfgs):  # before Ray starts: a folder another run writes is refused at once
        return _run_on_ray(cfgs, tok, prompts, eval_prompts, plan)


def _run_on_ray(cfgs: dict, tok, prompts, eval_prompts, plan) -> int:
    """rl ppo-ray from the checked settings and the placement plan: Ray, the roles, the engines, the loop."""
    r, a = cfgs["rollout"], cfgs["ray"]
    import ray

    # lazy: the Ray factory and rl-placement import ray; `rl ppo-ray --help` stays light
    from rl_cli.ray_factory import RayFactory
    from rl_core.rl.build import build_run
    from rl_placement import PlacementError, create_placement_groups

    address = cluster_address(a.ray_address, a.num_gpus)  # --ray_address, RAY_ADDRESS, a `ray start` cluster here
    if address:
        connect(address)  # RAY_AUTH_MODE=token when a token is at hand; one line when the cluster refuses
    else:
        _local_ray_env()
        # "local": always a fresh cluster of our own; a bare ray.init() would join whatever a stale
        # /tmp/ray/ray_current_cluster names (a cluster not shut down) and refuse num_gpus
        ray.init(address="local", num_gpus=a.num_gpus, include_dashboard=False, log_to_driver=True)
    placed = factory = run = None
    try:
        try:
            placed = create_placement_groups(plan, strategy=a.placement_strategy)
        except PlacementError as e:
            raise SystemExit(f"rl ppo-ray: the placement does not fit this cluster: {e}") from None

        exts = extensions.resolved(cfgs["cli"].extension)  # the role actors import them before they build
        factory = RayFactory(
            placed,
            colocated=a.colocate_all_models,
            call_timeout_s=a.call_timeout_s,
            engine_env=DETERMINISTIC_VLLM_ENV if cfgs["strategy"].full_determinism else None,
            role_env={extensions.ENV: os.pathsep.join(exts)} if exts else None,
            partial_rollout=bool(cfgs["ppo"].async_rl and cfgs["ppo"].async_rl.partial_rollout),
        )
        factory.spawn_engines(r.kind)  # the engines' processes and imports start beside the models' loading
        try:
            run = build_run(
                run_config(cfgs),
                factory,
                prompts=prompts,
                tokenizer=tok,
                reward_fn=cfgs["reward"].build(),
                metrics=metrics_logger(cfgs),
                eval_prompts=eval_prompts,
                ptx=pretrain_items(cfgs, tok, len(prompts)),
            )
        except ValueError as e:
            raise SystemExit(f"rl ppo-ray: {e}") from None
        print(f"[rl ppo-ray] {factory.describe()}", flush=True)

        try:
            run.trainer.fit()
        except RewardError as e:  # more reward calls failed than --reward_max_failure_rate tolerates
            raise SystemExit(f"rl ppo-ray: {e}") from None
        return _finish("ppo-ray", run.trainer, cfgs)
    finally:
        if run is not None:
            run.close()
        if factory is not None:
            factory.shutdown()
        if placed is not None:
            placed.remove()
        ray.shutdown()
