"""``rl serve-rm`` (and ``python -m rl_cli.serve_rm``, OpenRLHF's ``openrlhf.cli.serve_rm`` habit): a reward server.

What it serves, one of:

- ``--reward_pretrain FOLDER``: a reward model (``rl rm``'s output: a model folder with its
  score head), scoring each prompt + response (OpenRLHF's ``query``) in batches of
  ``--batch_size``, truncated to ``--max_len`` tokens, optionally normalised
  (``--normalize_reward``), as OpenRLHF's ``serve_rm`` does;
- ``--reward_fn SPEC`` / ``--remote_rm_url FILE.py``: the reward functions ``rl ppo`` takes,
  with the same flags (``--reward_workers``, ``--reward_timeout``, ...), including
  OpenRLHF's reward files (``reward_func(queries, prompts, labels)``; their scores and
  extra logs go back in the reply).

It listens on ``--host``/``--port`` (127.0.0.1:5000) at ``POST /``, ``/score`` and
OpenRLHF's ``/get_reward``, and answers our clients (``rl ppo --remote_rm_url``) and
OpenRLHF's (:mod:`rl_rollout.rewards.server` has the wire format and the limits). A
token is required (``RL_REWARD_TOKEN``, or ``--token``) unless ``--allow_no_token``, which
OpenRLHF's client needs: it sends none. Runs until Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path

from rl_cli.config import build_parser
from rl_cli.errors import CliArgs, set_debug, user_errors
from rl_cli.loading import resolve
from rl_cli.train import _local_models
from rl_rollout.config import RewardConfig, meta
from rl_rollout.rewards import RewardLoadError
from rl_rollout.rewards.server import RewardServerConfig


@dataclass(frozen=True)
class RewardModelArgs:
    """A reward model to serve (OpenRLHF's ``serve_rm`` flags)."""

    reward_pretrain: str | None = field(
        default=None,
        metadata=meta(
            "a reward model folder (rl rm's output, with its score head), or its hub id in the local HF cache, to serve",
            openrlhf=("reward.model_name_or_path",),
        ),
    )
    normalize_reward: bool = field(
        default=False, metadata=meta("apply the model's stored reward mean/std", openrlhf=("reward.normalize_enable",))
    )
    max_len: int = field(
        default=2048,
        metadata=meta("tokens per prompt + response; longer ones are truncated", openrlhf=("data.max_len",)),
    )
    batch_size: int | None = field(default=None, metadata=meta("texts per forward pass (default: the whole request)"))
    bf16: bool = field(default=True, metadata=meta("bfloat16 weights (false: float32); --param_dtype overrides"))
    param_dtype: str | None = field(
        default=None, metadata=meta("bf16 | fp16 | fp32 (default: from --bf16)", openrlhf=("ds.param_dtype",))
    )
    flash_attn: bool = field(default=False, metadata=meta("flash_attention_2 (needs flash-attn installed)"))
    attn_implementation: str | None = field(
        default=None,
        metadata=meta(
            "sdpa | eager | flash_attention_2 (default: flash-attn when importable, else sdpa)",
            openrlhf=("ds.attn_implementation",),
        ),
    )

    def __post_init__(self) -> None:
        if self.max_len < 1 or (self.batch_size is not None and self.batch_size < 1):
            raise ValueError(f"max_len and batch_size must be >= 1, got {self.max_len}, {self.batch_size}")
        if self.param_dtype not in (None, "bf16", "fp16", "fp32"):
            raise ValueError(f"param_dtype must be bf16, fp16 or fp32, got {self.param_dtype!r}")

    @property
    def dtype(self) -> str:
        return self.param_dtype or ("bf16" if self.bf16 else "fp32")

    @property
    def attn(self) -> str | None:
        # lazy: rl-core's models (numpy, the hub); `rl serve-rm --help` stays light
        from rl_core.attention import requested_attention

        return requested_attention(self.attn_implementation, self.flash_attn)


class RewardModelScorer:
    """``score(prompts, responses, labels, queries=None)``: the model's reward for each prompt + response."""

    def __init__(self, a: RewardModelArgs) -> None:
        import torch
        from transformers import AutoTokenizer

        # lazy: rl-core's models (numpy, the hub); `rl serve-rm --help` stays light
        from rl_core.models import RewardModel

        if a.reward_pretrain is None:
            raise ValueError("a reward model scorer needs --reward_pretrain FOLDER")
        path = Path(a.reward_pretrain)
        if not (path / "config.json").is_file():
            raise ValueError(f"--reward_pretrain {path}: not a model folder (no config.json)")
        self.torch = torch
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        try:  # rl rm's head or OpenRLHF's (<value_head_prefix>.weight); none: a random head would serve noise
            self.model = RewardModel.from_pretrained(path, dtype=a.dtype, attn_implementation=a.attn, require_head=True)
        except ValueError as e:
            raise ValueError(f"--reward_pretrain {e}; or serve a reward function with --reward_fn") from None
        self.model = self.model.to(self.device).eval()
        self.tok = AutoTokenizer.from_pretrained(path)
        self.tok.padding_side = "left"
        if self.tok.pad_token is None:
            self.tok.pad_token = self.tok.eos_token
        self.args = a

    def score(self, prompts, responses, labels=None, queries=None) -> list[float]:
        texts = list(queries) if queries is not None else [p + r for p, r in zip(prompts, responses, strict=True)]
        size = self.args.batch_size or max(1, len(texts))
        out: list[float] = []
        with self.torch.no_grad():
            for i in range(0, len(texts), size):
                enc = self.tok(
                    texts[i : i + size],
                    return_tensors="pt",
                    add_special_tokens=False,
                    padding=True,
                    truncation=True,
                    max_length=self.args.max_len,
                ).to(self.device)
                out += self.model(
                    enc["input_ids"], enc["attention_mask"], normalize=self.args.normalize_reward
                ).tolist()
        return out


def _groups() -> dict[str, type]:
    return {"model": RewardModelArgs, "reward": RewardConfig, "server": RewardServerConfig, "cli": CliArgs}


def _describe(cfgs: dict) -> str:
    lines = []
    for group, obj in cfgs.items():
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            lines.append(f"  {group}.{f.name} = {'***' if 'token' in f.name and value else repr(value)}")
    return "\n".join(lines)


@user_errors("rl serve-rm")
def main(argv: list[str] | None = None) -> int:
    groups = _groups()
    parser, flags = build_parser("rl serve-rm", __doc__.splitlines()[0], groups)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        cfgs = resolve(groups, args, flags)
        token = cfgs["server"].resolved_token()
    except (ValueError, FileNotFoundError) as e:
        parser.error(str(e))
    m, r = cfgs["model"], cfgs["reward"]
    if bool(m.reward_pretrain) == r.given:
        parser.error(
            "serve one thing: --reward_pretrain FOLDER (a reward model), or --reward_fn SPEC / "
            "--remote_rm_url FILE.py (reward functions, as rl ppo takes them)"
        )
    if m.reward_pretrain:
        cfgs["model"] = m = _local_models("rl serve-rm", m)  # a hub id -> its local HF cache folder
        set_debug(cfgs["cli"].debug)
        # lazy: rl-core's models (numpy, the hub); `rl serve-rm --help` stays light
        from rl_core.preflight import check_models

        cfgs["model"] = m = check_models(m)  # config.json and weights, before the model loads
    if getattr(args, "print_config", False):
        print(_describe(cfgs))
        return 0

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        scorer = RewardModelScorer(m) if m.reward_pretrain else r.build()
        server = cfgs["server"].make(getattr(scorer, "score_record", None) or scorer.score)
        server.start()
    except (ValueError, OSError, RewardLoadError) as e:
        parser.error(str(e))
    what = m.reward_pretrain or r.reward_fn or r.remote_rm_url
    print(
        f"[rl serve-rm] serving {what} at {server.url} (POST /, /score, /get_reward; GET /health); token "
        f"{'required' if token else 'NOT required (--allow_no_token)'}",
        flush=True,
    )

    def stop(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    try:
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
        close = getattr(scorer, "close", None)
        if callable(close):
            close()
        print(f"[rl serve-rm] stopped; replies by status {dict(sorted(server.counts.items()))}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
