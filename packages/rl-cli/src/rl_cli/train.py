"""``rl sft | rm | dpo | kto``: flags -> configs -> data, models, DeepSpeed -> trainer.fit().

Each command is a :class:`Command` of :mod:`rl_cli.train_commands`: its trainer config
class, its dataset class and how to build the trainer. Flags come from ``ModelArgs``, rl_core's ``DataConfig``,
``StrategyConfig`` and the trainer's config (:mod:`rl_cli.config`). Every run prints
the resolved batch arithmetic (global batch, micro batch, accumulation steps, data
parallel size, total optimizer steps) and the data report before training starts.
``--eval_dataset`` (same formats and keys as ``--dataset``) adds an eval set that the
trainer measures every ``--eval_steps`` steps and after the last one.
Works alone (one process) and under ``torchrun`` / ``deepspeed`` (several ranks).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys

from rl_cli.config import FALSE, TRUE, build_parser
from rl_cli.errors import UserError, set_debug, user_errors
from rl_cli.loading import resolve
from rl_cli.train_commands import (  # noqa: F401  (re-exported: their old home)
    COMMANDS,
    Command,
    ModelArgs,
    _groups,
)

logger = logging.getLogger(__name__)


def _wandb_key(argv: list[str], parser=None) -> list[str]:
    """OpenRLHF's ``--use_wandb KEY`` (``--use_wandb=KEY``, ``--logger.wandb.key KEY``): the key goes to
    WANDB_API_KEY and the flag becomes true, so the key is never a config value, printed or logged.

    The spellings are those the parser gives ``logger.use_wandb`` (all its aliases), else the usual ones.
    """

    names = {n for a in getattr(parser, "_actions", ()) if a.dest == "logger.use_wandb" for n in a.option_strings} or {
        "--use_wandb",
        "--logger.use_wandb",
        "--logger.wandb.key",
    }  # (the flag and its hidden aliases)
    out = list(argv)
    for i, a in enumerate(out):
        flag, eq, value = a.partition("=")
        if flag not in names:
            continue
        if eq:
            if value.lower() not in TRUE | FALSE:
                os.environ["WANDB_API_KEY"] = value
                out[i] = f"{flag}=true"
        elif i + 1 < len(out) and not out[i + 1].startswith("--") and out[i + 1].lower() not in TRUE | FALSE:
            os.environ["WANDB_API_KEY"] = out[i + 1]
            out[i + 1] = "true"
    key = os.environ.get("WANDB_API_KEY")
    if key and any(key in a for a in sys.argv):  # wandb records sys.argv in the run's metadata
        sys.argv[:] = [a.replace(key, "true") for a in sys.argv]
    return out


def _local_models(prog: str, model_cfg):
    """Hub ids (``--pretrain org/name``) -> folders of the local HF cache. A missing one raises ModelNotFoundError,
    which the command's guard (:func:`rl_cli.errors.user_errors`) prints in one line (exit code 2)."""
    # lazy: rl-core (numpy, the hub, its models); `rl --help` imports this module for the command list and stays light
    from rl_core.hub import resolve_models

    return resolve_models(model_cfg)


def _wandb_installed(prog: str, logger_cfg) -> None:
    """--use_wandb without wandb installed stops before any model loads, in one line naming the extra."""
    try:
        logger_cfg.check()
    except RuntimeError as e:
        raise SystemExit(f"{prog}: {e}") from None


def check_moe(aux_loss_coef: float, pretrain: str) -> None:
    """With ``--aux_loss_coef``, a model without experts ends the command in one line, before it loads."""
    if not aux_loss_coef:
        return
    from transformers import AutoConfig

    # lazy: rl-core (numpy, the hub, its models); `rl --help` imports this module for the command list and stays light
    from rl_core.models import check_moe_aux_loss

    try:
        check_moe_aux_loss(AutoConfig.from_pretrained(pretrain))
    except ValueError as e:
        raise UserError(str(e)) from e


def _check_teacher(parser, cfgs):
    """``rl sft --teacher_pretrain``: what knowledge distillation cannot run with, the teacher's folder and its
    tokenizer (the student's), all before any model loads; the train config with the teacher's local folder."""
    # lazy: rl-core (numpy, the hub, its models); `rl --help` imports this module for the command list and stays light
    from rl_core.preflight import check_model, check_teacher_tokenizer

    kd, st = cfgs["train"].kd, cfgs["strategy"]
    if cfgs["model"].fused_lm_head:
        parser.error(
            "--teacher_pretrain compares the student's and the teacher's logits, which --fused_lm_head never "
            "holds whole: drop --fused_lm_head (or --teacher_pretrain)"
        )
    if st.ring_attn_size > 1:
        parser.error(
            f"--teacher_pretrain with --ring_attn_size {st.ring_attn_size}: knowledge distillation needs each "
            "row's whole logits on one rank and ring attention splits them; use --ring_attn_size 1"
        )
    if kd.teacher_offload:
        try:
            st.check_param_offload("--teacher_offload")
        except ValueError as e:
            parser.error(str(e))
    teacher = check_model(kd.teacher_pretrain, flag="--teacher_pretrain")
    check_teacher_tokenizer(
        cfgs["model"].pretrain,
        teacher,
        use="knowledge distillation compares the two models' next-token distributions token id by token id",
    )
    return dataclasses.replace(cfgs["train"], kd=dataclasses.replace(kd, teacher_pretrain=teacher))


def _check_images(parser, name: str, cfgs) -> None:
    """``--image_key``: vision-language rows for rl sft and rl dpo (:mod:`rl_core.data.images`); refused where
    the images would not reach the model."""
    key = cfgs["data"].image_key
    if name not in ("sft", "dpo"):
        parser.error(
            f"--image_key {key!r}: rl {name} with images is not built (rl sft, rl dpo and rl ppo train on "
            f"images); drop --image_key"
        )
    train = cfgs["train"]
    if getattr(train, "kd", None) is not None:
        parser.error(
            f"--image_key {key!r} with --teacher_pretrain: knowledge distillation with images is not built; "
            f"drop one of them"
        )
    if getattr(train, "pretrain_mode", False):
        parser.error(f"--image_key {key!r}: --pretrain_mode trains on plain text; drop one of them")


@user_errors(lambda name, *_, **__: f"rl {name}")
def run(name: str, argv: list[str] | None = None) -> int:
    cmd = COMMANDS[name]
    groups = _groups(cmd)
    parser, flags = build_parser(f"rl {name}", f"rl {name}: {cmd.help}", groups)
    args = parser.parse_args(_wandb_key(sys.argv[1:] if argv is None else argv, parser))
    try:
        cfgs = resolve(groups, args, flags)
    except (ValueError, FileNotFoundError) as e:
        parser.error(str(e))
    if cfgs["model"].fused_lm_head:
        if name == "rm":
            parser.error(
                "--fused_lm_head: rl rm trains a reward model, whose head gives a score, not token "
                "log-probs; drop --fused_lm_head"
            )
        # lazy: rl-core (numpy, the hub, its models); `rl --help` imports this module for the command list and stays light
        from rl_core.models import check_fused_lm_head

        try:
            check_fused_lm_head(True, cfgs["strategy"])
        except ValueError as e:
            parser.error(str(e))
    if cfgs["data"].image_key is not None:
        _check_images(parser, name, cfgs)
    if (quant := cfgs["model"].load_in_4bit) is not None:  # QLoRA: ZeRO-3 cannot partition 4-bit weights
        try:
            quant.check(lora_rank=cfgs["model"].lora_rank, zero_stage=cfgs["strategy"].zero_stage)
        except ValueError as e:
            parser.error(str(e))
    if getattr(args, "print_config", False):  # a dry run: before any path is read or model loaded
        # lazy: pulls rl-core (numpy, the hub, PyYAML); `rl --help` imports this module and stays light
        from rl_cli.dry_run import print_config

        print_config(name, cfgs)
        return 0
    if not cfgs["model"].pretrain:
        parser.error(
            "--pretrain is required: a local HF model folder (config.json, weights, tokenizer) or a hub "
            "id in the local Hugging Face cache"
        )
    if not cfgs["data"].dataset:
        parser.error("--dataset is required: a .jsonl/.json/.parquet file or a save_to_disk folder")
    cfgs["model"] = _local_models(f"rl {name}", cfgs["model"])
    set_debug(cfgs["cli"].debug)
    # lazy: rl-core (numpy, the hub, its models); `rl --help` imports this module for the command list and stays light
    from rl_core.preflight import check_models, load_tokenizer

    cfgs["model"] = check_models(cfgs["model"])  # config.json and weights, before anything loads
    if getattr(cfgs["train"], "kd", None) is not None:  # rl sft --teacher_pretrain: before any model loads
        cfgs["train"] = _check_teacher(parser, cfgs)
    _wandb_installed(f"rl {name}", cfgs["logger"])
    check_moe(getattr(cfgs["train"], "aux_loss_coef", 0), cfgs["model"].pretrain)
    if getattr(cfgs["train"], "ref_offload", False):  # rl dpo / kto: before any model loads
        try:
            cfgs["strategy"].check_param_offload("--ref_offload")
        except ValueError as e:
            parser.error(str(e))
    # lazy: rl-core (numpy, the hub, its models); `rl --help` imports this module for the command list and stays light
    from rl_core.configs import check_eval_set  # rl-core loads torch: after the parse, as the trainers are

    try:
        check_eval_set(cfgs["train"].eval_steps, bool(cfgs["data"].eval_dataset))
    except ValueError as e:
        parser.error(str(e))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    # lazy: rl-core (numpy, the hub, its models); `rl --help` imports this module for the command list and stays light
    from rl_core.data import DataError, load_rows, training_rows
    from rl_core.strategy import DeepSpeedStrategy

    strategy = DeepSpeedStrategy(cfgs["strategy"])
    data = cfgs["data"]
    tok = load_tokenizer(
        cfgs["model"].pretrain, use_fast=not data.disable_fast_tokenizer, chat_template=data.tokenizer_chat_template
    )
    if getattr(cfgs["train"], "pretrain_mode", False):  # rl sft --pretrain_mode: every token of the text
        # lazy: rl-core (numpy, the hub, its models); `rl --help` imports this module for the command list and stays light
        from rl_core.data import PretrainDataset

        unread = [
            f
            for f, on in (
                ("--output_key", data.output_key),
                ("--apply_chat_template", data.apply_chat_template),
                ("--input_template", data.input_template),
            )
            if on
        ]
        if unread:
            raise UserError(
                f"--pretrain_mode trains on the --input_key text as is; {', '.join(unread)} would not be "
                f"used: drop it (or drop --pretrain_mode for prompt/response SFT)"
            )

        dataset_cls: type = PretrainDataset  # as Command.dataset_cls gives
    else:
        dataset_cls = cmd.dataset_cls()
    vision: dict = {}
    if data.image_key is not None:  # rl sft / rl dpo on a vision-language model (_check_images)
        # lazy: rl-core (numpy, the hub, its models); `rl --help` imports this module for the command list and stays light
        from rl_core.preflight import load_processor

        proc = load_processor(cfgs["model"].pretrain)
        proc.tokenizer = tok  # the run's tokenizer (its chat template): the rows and the export use the same one
        vision = {"processor": proc}
    ds = dataset_cls(training_rows(data, cfgs["strategy"].seed), tok, data, **vision)
    eval_ds = None
    if data.eval_dataset:
        try:
            eval_ds = dataset_cls(
                load_rows(data.eval_dataset, data.eval_split, data.max_eval_samples, skip_bad=data.skip_bad_rows),
                tok,
                data,
                **vision,
            )
        except DataError as e:  # say which of the two sets is bad
            raise type(e)(f"eval set (--eval_dataset {data.eval_dataset}): {e}") from None
    global_batch = cfgs["strategy"].train_batch_size
    if len(ds) < global_batch:  # the trainer would find it after the model loaded
        raise UserError(
            f"the dataset ({data.dataset}) has {len(ds)} usable rows, fewer than one global batch "
            f"(--train_batch_size {global_batch}); lower --train_batch_size to at most {len(ds)} "
            f"or add data"
        )
    strategy.setup_distributed()  # after the checks above: joining the ranks can take a while
    rank0 = strategy.is_rank_0()
    try:
        plan = strategy.batch_plan(len(ds), cfgs["train"].max_epochs)
    except ValueError as e:  # the batch sizes do not fit the ranks
        raise UserError(str(e)) from e
    if rank0:
        print(f"[rl {name}] {ds.report.summary()}")
        if eval_ds is not None:
            print(f"[rl {name}] eval set: {eval_ds.report.summary()}")
        print(f"[rl {name}] {plan.describe()}", flush=True)
    ck = cfgs["train"].ckpt
    # lazy: rl-core (numpy, the hub, its models); `rl --help` imports this module for the command list and stays light
    from rl_core.folder_lock import hold

    # before the model loads: the folders this run writes are its own (rank 0 locks them for all; the trainer
    # shares the locks), then a damaged newest checkpoint is skipped and named, a folder with none usable refused
    with (
        hold({"--run_dir": cfgs["train"].run_dir, "--ckpt_path": ck.ckpt_path}, {"--save_path": ck.save_path})
        if rank0
        else hold({})
    ):
        if ck.load_checkpoint and ck.ckpt_path:
            # lazy: rl-core (numpy, the hub, its models); `rl --help` imports this module for the command list and stays light
            from rl_core.checkpoint import CheckpointManager

            CheckpointManager(ck.ckpt_path, strategy, ck.max_ckpt_num, ck.max_ckpt_mem).usable()
        trainer = cmd.build(strategy, cfgs, tok, ds, cfgs["train"], eval_ds)
        losses = trainer.fit()
    if rank0:
        t = cfgs["train"]
        where = {
            k: v
            for k, v in (("save_path", t.ckpt.save_path), ("ckpt_path", t.ckpt.ckpt_path), ("run_dir", t.run_dir))
            if v
        }
        first, last = (f"{losses[0]:.4f}", f"{losses[-1]:.4f}") if losses else ("-", "-")
        evals = trainer.eval_history
        ev = f", eval loss {evals[0]['loss']:.4f} -> {evals[-1]['loss']:.4f}" if evals else ""
        print(f"[rl {name}] done: {len(losses)} steps, loss {first} -> {last}{ev}; {where}", flush=True)
    return 0


def module_main(name: str) -> None:
    """Entry of ``python -m rl_cli.train_<name>``."""
    sys.exit(run(name))
