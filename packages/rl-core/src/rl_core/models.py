"""The trainable models over transformers: Actor, Critic, RewardModel.

Alignment convention, shared with :mod:`rl_core.data`: every per-token output has
the shape of ``input_ids`` ``[B, T]`` and position ``t`` describes token ``t``:
``logprobs[:, t] = log p(x_t | x_<t)`` and ``values[:, t]`` is the critic's value of
the state before ``x_t`` was generated (both come from position ``t - 1``). Position
0 has no predecessor and holds 0. A loss mask with ``mask[t] = 1`` on target tokens
therefore applies to logprobs and values without any shifting by the caller.

Packed sequences: pass ``position_ids`` restarting at 0 per sequence and no
``attention_mask``; transformers then keeps attention within each sequence
(flash-attn varlen, or a block-diagonal mask for sdpa). The first token of each
packed sequence gets logprob 0, never a prediction from the previous sequence.
With ring attention on (:mod:`rl_core.ring_attention`), a packed row is computed in slices over the ring
group and every forward returns the whole row's outputs on every rank of the group; padded rows are packed
first and their outputs put back (each row's first real token then holds 0, as at position 0 of a packed one).

The reference model is a frozen Actor (:func:`frozen`). LoRA goes through peft.
Vision-language models (a config with ``vision_config``) load as ``AutoModelForImageTextToText``; their
forwards take the image tensors (``pixel_values`` ...) beside the ids and compute their own positions
(Qwen-VL's multimodal RoPE), so padded rows pass no ``position_ids``; packed rows with images are not built.
Mixture-of-experts models: :meth:`Actor.enable_moe_aux_loss` makes every forward also return the
router's load-balancing loss (transformers' own, ``output_router_logits``), as OpenRLHF's ``--aux_loss_coef``
turns it on; the saved config is left as it was.
Critic and RewardModel save as the base model's folder plus ``rl_head.safetensors``
and ``rl_head.json`` (head kind, reward mean/std), so transformers loads the body
and :meth:`RewardModel.from_pretrained` restores the head.
"""

from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from rl_algos import logprobs_and_entropy_from_logits, logprobs_from_logits
from rl_core.attention import attention_implementation
from rl_core.hub import ModelNotFoundError, resolve_model, resolve_models  # noqa: F401 - model args resolve here too

logger = logging.getLogger(__name__)
Tensor = torch.Tensor
HEAD_FILE, HEAD_META = "rl_head.safetensors", "rl_head.json"


@dataclass(frozen=True)
class LoraSpec:
    """peft LoRA settings (OpenRLHF flags ``--lora_rank``, ``--lora_alpha``, ``--target_modules``)."""

    rank: int = 0
    alpha: int = 16
    dropout: float = 0.0
    target_modules: tuple[str, ...] | str = "all-linear"

    @classmethod
    def of(cls, rank: int, alpha: int, dropout: float, target_modules: str) -> LoraSpec | None:
        """From the flags (``--target_modules`` names joined by commas, or ``all-linear``); None for rank 0."""
        if rank < 0:
            raise ValueError(f"lora_rank (--lora_rank) must be >= 0, got {rank}")
        if rank == 0:
            return None
        mods = target_modules if target_modules == "all-linear" else tuple(
            m.strip() for m in target_modules.split(",") if m.strip())
        if not mods:
            raise ValueError(f"--target_modules {target_modules!r} names no module; give module names joined by "
                             f"commas (q_proj,v_proj) or all-linear")
        return cls(rank, alpha, dropout, mods)


def _dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    table = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32,
             "fp16": torch.float16, "float16": torch.float16}
    if name not in table:
        raise ValueError(f"unknown dtype {name!r}; valid: {', '.join(table)}")
    return table[name]


def _check_folder(path: str | Path) -> Path:
    p = Path(path)
    if not (p / "config.json").is_file():
        raise FileNotFoundError(
            f"{p} is not a transformers model folder (no config.json); pass --pretrain a local folder saved "
            f"with save_pretrained (this stack never downloads weights at run time)")
    return p


def _load(auto_cls, path, dtype, attn, gradient_checkpointing, lora: LoraSpec | None, use_liger_kernel: bool = False,
          packed: bool = False, experts_implementation: str | None = None):
    if use_liger_kernel:
        from rl_core.liger import require_liger

        require_liger()  # before the weights load, not after
    model_config = None
    if attn is None and packed:  # the default for packed rows depends on the model's attention (sliding window)
        from transformers import AutoConfig

        model_config = AutoConfig.from_pretrained(_check_folder(path))
    if attn == "rl_ring":  # ring attention (rl_core.ring_attention): every role of a run with --ring_attn_size > 1
        from rl_core.ring_attention import register

        impl = register()
    else:
        impl = attention_implementation(attn, packed=packed, dtype=dtype, model_config=model_config)
    extra = {"experts_implementation": experts_implementation} if experts_implementation else {}
    try:
        model = auto_cls.from_pretrained(_check_folder(path), dtype=_dtype(dtype), attn_implementation=impl, **extra)
    except ValueError as e:
        if extra and "experts_implementation" in str(e):  # transformers' own check, which lists the valid ones
            from rl_core.preflight import InputError

            raise InputError(f"--experts_implementation {experts_implementation}: {e}") from e
        raise
    if use_liger_kernel:
        from rl_core.liger import apply_liger_kernel

        apply_liger_kernel(model)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    if lora is not None and lora.rank > 0:
        model = _lora(model, lora)
    return model


def _lora(model, lora: LoraSpec):
    from peft import LoraConfig, get_peft_model

    model.enable_input_require_grads()
    return get_peft_model(model, LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                            target_modules=lora.target_modules, bias="none"))


def check_moe_aux_loss(config) -> None:
    """Raises ValueError (one line) unless the transformers ``config`` is a mixture of experts whose forward
    returns the router's load-balancing loss (``output_router_logits``, as OpenRLHF checks)."""
    if "output_router_logits" not in config.to_dict():
        raise ValueError(f"--aux_loss_coef is the MoE load-balancing loss, but the model ({config.model_type}) is "
                         f"not a mixture of experts (its config has no output_router_logits); drop --aux_loss_coef "
                         f"or give 0")


def _ring_slice(input_ids: Tensor, attention_mask: Tensor | None, position_ids: Tensor | None):
    """:func:`rl_core.ring_attention.sharded` for a packed row (padded rows are packed first: :func:`_ring_padded`)."""
    from rl_core import ring_attention

    if ring_attention.current() is not None and (attention_mask is not None or position_ids is None
                                                 or input_ids.shape[0] != 1):
        raise ValueError(f"ring attention splits one packed row per forward; got {input_ids.shape[0]} padded "
                         f"rows (position_ids given: {position_ids is not None}, attention_mask given: "
                         f"{attention_mask is not None})")
    return ring_attention.sharded(position_ids) if position_ids is not None else contextlib.nullcontext()


def _ring_padded(attention_mask: Tensor | None) -> bool:
    """Padded rows under ring attention: the forward packs their real tokens into one row, as OpenRLHF's
    ``unpad_and_slice_tensor`` does, and puts the per-token outputs back (:func:`_unpad`, :func:`_repad`)."""
    from rl_core import ring_attention

    return attention_mask is not None and ring_attention.current() is not None


def _unpad(input_ids: Tensor, attention_mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Padded rows ``[B, T]`` -> ``(ids [1, N], position ids [1, N], index [N])``: the real tokens in row order, each
    row's positions from 0, and where each came from in the flattened ``[B * T]``."""
    idx = attention_mask.reshape(-1).nonzero().squeeze(1)
    return input_ids.reshape(-1)[idx][None], _positions(attention_mask).reshape(-1)[idx][None], idx


def _repad(x_1N: Tensor, idx: Tensor, shape) -> Tensor:
    """A packed row's per-token output back in the padded ``[B, T]`` layout, 0 at the padding (differentiable)."""
    return x_1N.new_zeros(shape[0] * shape[1]).index_put((idx,), x_1N[0]).view(shape)


def _openrlhf_head(path: Path, prefix: str) -> Tensor | None:
    """``<prefix>.weight`` from a model folder's safetensors (one file or an index of shards), or None."""
    from safetensors import safe_open

    name = f"{prefix}.weight"
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shard = json.loads(index.read_text()).get("weight_map", {}).get(name)
        files = [path / shard] if shard else []
    else:
        files = sorted(path.glob("*.safetensors"))
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            if name in st.keys():
                return st.get_tensor(name).float()
    return None


def _positions(attention_mask: Tensor) -> Tensor:
    """Position ids that count real tokens only (left padding), as the engine saw them."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def _shift_right(x_BT: Tensor, position_ids: Tensor | None) -> Tensor:
    """Move per-position outputs one step right (position t-1 -> t), 0 at sequence starts."""
    out = torch.zeros_like(x_BT)
    out[:, 1:] = x_BT[:, :-1]
    if position_ids is not None:
        out = out.masked_fill(position_ids == 0, 0)
    return out


# causal LMs whose logits are exactly lm_head(decoder(...).last_hidden_state) in transformers (Actor.enable_fused_lm_head)
FUSED_LM_HEAD_MODELS = frozenset({"llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral"})


def check_fused_lm_head(fused_lm_head: bool, strategy_cfg) -> None:
    """Before any model loads: the fused head reads the LM head's weight outside the head's own forward, where
    ZeRO-3 keeps it partitioned."""
    if fused_lm_head and strategy_cfg.zero_stage == 3:
        raise ValueError("--fused_lm_head with --zero_stage 3 is not built: ZeRO-3 gathers the LM head's weight only "
                         "inside the head's own forward, which the fused path skips; use --zero_stage 0, 1 or 2, or "
                         "drop --fused_lm_head")


@dataclass
class ActorOutput:
    logprobs: Tensor  # [B, T] float32, logprobs[:, t] = log p(x_t | x_<t), 0 at t = 0
    entropy: Tensor | None = None  # [B, T] entropy of the distribution that produced x_t
    aux_loss: Tensor | None = None  # [] the MoE router's load-balancing loss (Actor.enable_moe_aux_loss)
    weighted: Tensor | None = None  # [] sum(lp_weights * logprobs) when the forward was given lp_weights


class Actor(nn.Module):
    """A causal LM that returns per-token logprobs of its input (see the module's convention)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.moe_aux_loss = False  # enable_moe_aux_loss(): forwards return the router's load-balancing loss
        self.fused_lm_head = False  # enable_fused_lm_head(): log-probs from the hidden states, chunk by chunk
        from rl_rollout.vision import placeholder_token_ids

        # a VLM's image placeholders: the engines never sample them, so the log-probs leave them out too
        self._placeholders = placeholder_token_ids(model.config)

    @property
    def is_vlm(self) -> bool:
        """A vision-language model: its forward takes image tensors (:mod:`rl_rollout.vision`)."""
        from rl_rollout.vision import is_vision_config

        return is_vision_config(self.config)

    def freeze_visual_encoder(self) -> int:
        """OpenRLHF's ``--freeze_visual_encoder``: every parameter outside the language model and the LM head (the
        vision tower, the projector) stops training; returns how many tensors were frozen. A text-only model
        raises: the flag would do nothing."""
        if not self.is_vlm:
            raise ValueError(f"--freeze_visual_encoder freezes a vision-language model's vision tower, but the "
                             f"policy ({self.config.model_type}) has none; drop --freeze_visual_encoder")
        frozen_n = 0
        for name, p in self.model.named_parameters():
            if "language_model" not in name and "lm_head" not in name:
                p.requires_grad_(False)
                frozen_n += 1
        return frozen_n

    def enable_fused_lm_head(self) -> None:
        """Forwards compute the LM head and the log-probs (and entropy) together, chunk by chunk
        (:func:`rl_algos.logprobs_from_hidden`): the ``[tokens, vocabulary]`` logits are never held whole, for one
        more LM-head matmul in backward. For text models whose causal-LM output is exactly ``lm_head(decoder
        output)``: the architectures of :data:`FUSED_LM_HEAD_MODELS`, an ``nn.Linear`` head (a LoRA adapter on
        the head is refused), no MoE load-balancing loss; anything else fails here, naming the flag."""
        def refuse(why: str):
            raise ValueError(f"--fused_lm_head: {why}; drop --fused_lm_head")

        model_type = self.config.model_type
        if self.is_vlm:
            refuse(f"not built for vision-language models ({model_type}): their forward merges the images in")
        if model_type not in FUSED_LM_HEAD_MODELS:
            refuse(f"model type {model_type!r} is not one whose logits are exactly lm_head(hidden) here (built for "
                   f"{', '.join(sorted(FUSED_LM_HEAD_MODELS))})")
        for key in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
            if getattr(self.config, key, None) not in (None, 1, 1.0):
                refuse(f"the model scales its logits ({key}={getattr(self.config, key)})")
        if self.moe_aux_loss:
            refuse("the MoE load-balancing loss (--aux_loss_coef) needs the router logits of the full forward")
        head = self.model.get_output_embeddings()
        if type(head) is not nn.Linear:
            refuse(f"the LM head is a {type(head).__name__}, not a plain Linear (a LoRA adapter on lm_head?)")
        self.fused_lm_head = True

    def _hidden(self, **kw) -> Tensor:
        """The decoder's last hidden states (the input of the LM head), through a peft wrapper's injected layers."""
        inner = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        out = inner.get_decoder()(**kw)
        return out.last_hidden_state

    def _head(self) -> nn.Linear:
        head = self.model.get_output_embeddings()
        if hasattr(head.weight, "ds_id"):
            raise ValueError("--fused_lm_head with ZeRO-3 (--zero_stage 3) is not built: the head's weight is "
                             "partitioned and gathered only inside its own forward; drop --fused_lm_head or use "
                             "--zero_stage 0, 1 or 2")
        return head

    def _fused_logprobs(self, hidden: Tensor, labels: Tensor, temperature: float, entropy: bool):
        from rl_algos import logprobs_from_hidden

        head = self._head()
        out = logprobs_from_hidden(hidden, head.weight, labels, bias=head.bias, temperature=temperature,
                                   return_entropy=entropy)
        return (out.logprobs, out.entropy) if entropy else (out, None)

    def _fused_weighted(self, hidden: Tensor, labels: Tensor, lp_weights_BT: Tensor, pos_for_shift: Tensor | None,
                        temperature: float) -> tuple[Tensor, Tensor]:
        """``(sum(w * lp), lp)`` with the gradients made in forward. The weights sit on the output's positions
        (``lp_BT[:, t]`` predicts token t); the kernel's row t predicts token t + 1, so they move one to the left;
        the last row's wrapped-around label and, in packed rows, the rows that predict a sequence's first token
        (``_shift_right`` drops their log-probs) weigh nothing."""
        from rl_algos import weighted_logprob_sum_from_hidden

        head = self._head()
        w = lp_weights_BT.float()
        if pos_for_shift is not None:
            w = w.masked_fill(pos_for_shift == 0, 0.0)
        w = torch.roll(w, -1, dims=1)
        w[:, -1] = 0.0
        return weighted_logprob_sum_from_hidden(hidden, head.weight, labels, w, bias=head.bias,
                                                temperature=temperature)

    def enable_moe_aux_loss(self) -> None:
        """Every forward returns ``aux_loss``: the router's load-balancing loss of a mixture-of-experts model
        (transformers computes it from the router logits, over the real tokens of the batch). A model without a
        router (no ``output_router_logits`` in its config) raises: a coefficient on it would do nothing."""
        check_moe_aux_loss(self.config)
        if self.fused_lm_head:
            raise ValueError("--aux_loss_coef with --fused_lm_head: the MoE load-balancing loss needs the router "
                             "logits of the full forward, which the fused head skips; drop one of the two")
        self.moe_aux_loss = True

    @classmethod
    def from_pretrained(cls, path: str | Path, *, dtype: str = "bf16", attn_implementation: str | None = None,
                        gradient_checkpointing: bool = False, lora: LoraSpec | None = None,
                        use_liger_kernel: bool = False, packed: bool = False,
                        freeze_visual_encoder: bool = False, experts_implementation: str | None = None,
                        fused_lm_head: bool = False) -> Actor:
        """``use_liger_kernel``: liger-kernel's fused RMSNorm / SwiGLU / RoPE (CUDA; rl_core.liger). ``packed``: the
        model will see packed rows (the default attention is then torch_varlen where it runs: rl_core.attention).
        A vision-language folder loads as ``AutoModelForImageTextToText``; ``freeze_visual_encoder``: see
        :meth:`freeze_visual_encoder` (before LoRA wraps the model). ``fused_lm_head``: see
        :meth:`enable_fused_lm_head`."""
        from rl_rollout.vision import causal_lm_class

        auto_cls = causal_lm_class(_check_folder(path))
        if not freeze_visual_encoder:
            actor = cls(_load(auto_cls, path, dtype, attn_implementation, gradient_checkpointing, lora,
                              use_liger_kernel, packed, experts_implementation))
        else:
            actor = cls(_load(auto_cls, path, dtype, attn_implementation, gradient_checkpointing, None,
                              use_liger_kernel, packed, experts_implementation))
            actor.freeze_visual_encoder()
            if lora is not None and lora.rank > 0:
                actor.model = _lora(actor.model, lora)
        if fused_lm_head:
            actor.enable_fused_lm_head()
        return actor

    @property
    def config(self):
        return self.model.config

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, position_ids: Tensor | None = None,
                *, temperature: float = 1.0, return_entropy: bool = False, lp_weights: Tensor | None = None,
                **images: Tensor) -> ActorOutput:
        """``images``: a vision-language model's image tensors of the batch (``pixel_values`` ...), padded rows
        only; the model then computes its own positions (multimodal RoPE) from the right-padded mask.

        ``lp_weights`` (``[B, T]`` like the log-probs, constants): the output's ``weighted`` is
        ``sum(lp_weights * logprobs)``, a loss linear in the log-probs (SFT's NLL). With the fused head its
        gradients are computed during forward (:func:`rl_algos.weighted_logprob_sum_from_hidden`: no recompute
        in backward) and ``logprobs`` are values only; use ``weighted`` for the loss."""
        if images and (attention_mask is None or _ring_padded(attention_mask)):
            raise ValueError("packed rows with images are not built (nor ring attention): run vision-language "
                             "prompts without --packing and with --ring_attn_size 1")
        if _ring_padded(attention_mask):  # ring attention computes packed rows: pack, run, put back
            ids, pos, idx = _unpad(input_ids, attention_mask)
            o = self.forward(ids, position_ids=pos, temperature=temperature, return_entropy=return_entropy)
            ent = None if o.entropy is None else _repad(o.entropy, idx, input_ids.shape)
            lp_BT = _repad(o.logprobs, idx, input_ids.shape)
            return ActorOutput(lp_BT, ent, o.aux_loss, None if lp_weights is None else (lp_BT * lp_weights).sum())
        if images:
            from rl_rollout.vision import token_types

            images = {**images, **token_types(self.config, input_ids, images)}
        if position_ids is None and attention_mask is not None:
            position_ids = None if images else _positions(attention_mask)
            pos_for_shift = None
        else:
            pos_for_shift = position_ids
        moe = {"output_router_logits": True} if self.moe_aux_loss else {}
        # Every position, the last one's label wrapped around (its log-prob is computed and dropped): the
        # kernels' logits gradient then comes back whole, where one of logits[:, :-1] would be copied into a
        # zero-filled [B, T, V] by the slice's backward (a write and a copy of all the logits per micro-batch).
        labels = torch.roll(input_ids, -1, dims=1)
        with _ring_slice(input_ids, attention_mask, position_ids) as shard:
            if shard is not None:  # ring attention: this rank's slice of the row (labels cut after the roll)
                if self.moe_aux_loss:
                    raise ValueError("the MoE load-balancing loss is not built with ring attention (each rank "
                                     "sees a slice of the router's tokens): drop --aux_loss_coef or use "
                                     "--ring_attn_size 1")
                input_ids, position_ids, labels = (shard.local(input_ids, 0), shard.positions,
                                                   shard.local(labels, 0))
            aux = weighted = None
            if self.fused_lm_head:  # the head and the log-probs together, chunk by chunk: no [B, T, V] logits
                hidden = self._hidden(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                      use_cache=False)
                if lp_weights is not None and shard is None and not return_entropy:  # gradients in forward
                    weighted, lp = self._fused_weighted(hidden, labels, lp_weights, pos_for_shift, temperature)
                    ent = None
                else:
                    lp, ent = self._fused_logprobs(hidden, labels, temperature, return_entropy)
            else:
                out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                 use_cache=False, **moe, **images)
                ent, logits, aux = None, out.logits, out.aux_loss if self.moe_aux_loss else None
                if self._placeholders:  # the distribution the engine sampled from: no image placeholder (-1e4: no
                    ids = torch.tensor(self._placeholders, device=logits.device)  # inf: the entropy stays finite)
                    logits = logits.index_fill(-1, ids, -1e4)
                if return_entropy:  # one pass over the logits for both on CUDA
                    lp, ent = logprobs_and_entropy_from_logits(logits, labels, temperature=temperature)
                else:
                    lp = logprobs_from_logits(logits, labels, temperature=temperature)
            if shard is not None:  # the whole row back on every rank of the group
                lp, ent = shard.gather(lp), (None if ent is None else shard.gather(ent))
        ent_BT = None if ent is None else _shift_right(ent, pos_for_shift)
        lp_BT = _shift_right(lp, pos_for_shift)
        if lp_weights is not None and weighted is None:
            weighted = (lp_BT * lp_weights).sum()
        return ActorOutput(lp_BT, ent_BT, aux, weighted)

    def save_pretrained(self, path: str | Path, state_dict: dict[str, Tensor] | None = None, **kw) -> None:
        self.model.save_pretrained(path, state_dict=state_dict, **kw)


def frozen(actor: Actor) -> Actor:
    """The reference model: the same network with gradients off and in eval mode."""
    for p in actor.parameters():
        p.requires_grad_(False)
    return actor.eval()


class _ScalarHeadModel(nn.Module):
    """A transformer body plus a linear head giving one number per position."""

    head_kind = "value"

    def __init__(self, body: nn.Module, head: nn.Linear | None = None, mean: float = 0.0, std: float = 1.0):
        super().__init__()
        self.body = body
        hidden = body.config.hidden_size
        if head is None:
            head = nn.Linear(hidden, 1, bias=False)
            nn.init.normal_(head.weight, std=1 / (hidden + 1))  # OpenRLHF's init for value/score heads
        self.head = head.to(next(body.parameters()).dtype)
        self.mean, self.std = float(mean), float(std)

    @property
    def config(self):
        return self.body.config

    @classmethod
    def from_pretrained(cls, path: str | Path, *, dtype: str = "bf16", attn_implementation: str | None = None,
                        gradient_checkpointing: bool = False, lora: LoraSpec | None = None,
                        use_liger_kernel: bool = False, packed: bool = False, value_head_prefix: str | None = None,
                        require_head: bool = False, experts_implementation: str | None = None):
        """Load the body from ``path`` and its head: ours (``rl_head.safetensors``, what rl rm writes), else
        OpenRLHF's (``<value_head_prefix>.weight`` in the model's own weights, the prefix from its config.json or
        ``score``; mean and std from config.json, as OpenRLHF's reward models keep them), else a fresh head, which
        ``require_head`` refuses (a reward model that scores: a random head would reward noise). A critic starts
        from a reward model's score head, as OpenRLHF's does. ``use_liger_kernel`` and ``packed`` as for
        :meth:`Actor.from_pretrained`."""
        from safetensors.torch import load_file
        from transformers import AutoModel

        path = _check_folder(path)
        body = _load(AutoModel, path, dtype, attn_implementation, gradient_checkpointing, lora, use_liger_kernel,
                     packed, experts_implementation)
        head, mean, std = None, 0.0, 1.0
        kinds = ("value", "score") if cls.head_kind == "value" else (cls.head_kind,)
        prefix = value_head_prefix or getattr(body.config, "value_head_prefix", None) or "score"
        if (path / HEAD_META).is_file():
            meta = json.loads((path / HEAD_META).read_text())
            if meta.get("kind") not in kinds:
                raise ValueError(f"{path} holds a {meta.get('kind')!r} head, but {cls.__name__} needs a "
                                 f"{cls.head_kind!r} head; load it with the matching class")
            head = nn.Linear(body.config.hidden_size, 1, bias=False)
            head.load_state_dict(load_file(path / HEAD_FILE))
            mean, std = meta.get("mean", 0.0), meta.get("std", 1.0)
            if meta.get("kind") != cls.head_kind:
                logger.info("%s: head initialised from %s's %s head", cls.__name__, path, meta.get("kind"))
        elif (weight := _openrlhf_head(path, prefix)) is not None:
            head = nn.Linear(body.config.hidden_size, 1, bias=False)
            head.load_state_dict({"weight": weight.reshape(1, -1)})
            mean, std = float(getattr(body.config, "mean", 0.0)), float(getattr(body.config, "std", 1.0))
            logger.info("%s: %s is an OpenRLHF-style model: head %s.weight, mean %g, std %g", cls.__name__, path,
                        prefix, mean, std)
        elif require_head:
            raise ValueError(f"{path} holds no {cls.head_kind} head: no {HEAD_META} (rl rm's) and no "
                             f"{prefix}.weight in its weights (OpenRLHF's); it is not a trained reward model. Train "
                             f"one with rl rm, or give --value_head_prefix if its head has another name")
        else:
            logger.info("%s: %s has no %s head, starting a fresh one", cls.__name__, path, cls.head_kind)
        return cls(body, head, mean, std)

    def hidden(self, input_ids, attention_mask=None, position_ids=None) -> Tensor:
        if position_ids is None and attention_mask is not None:
            position_ids = _positions(attention_mask)
        return self.body(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=False).last_hidden_state

    def per_token(self, input_ids, attention_mask=None, position_ids=None) -> Tensor:
        """The head's number at every position ``[B, T]`` float32 (with ring attention: this rank computes its
        slice of the packed row and the group's slices are gathered)."""
        if _ring_padded(attention_mask):  # ring attention computes packed rows: pack, run, put back
            ids, pos, idx = _unpad(input_ids, attention_mask)
            return _repad(self.per_token(ids, position_ids=pos), idx, input_ids.shape)
        with _ring_slice(input_ids, attention_mask, position_ids) as shard:
            if shard is None:
                return self.head(self.hidden(input_ids, attention_mask, position_ids)).squeeze(-1).float()
            h = self.hidden(shard.local(input_ids, 0), position_ids=shard.positions)
            return shard.gather(self.head(h).squeeze(-1).float())

    def save_pretrained(self, path: str | Path, state_dict: dict[str, Tensor] | None = None, **kw) -> None:
        """Body via transformers (loadable alone), head and its stats beside it."""
        from safetensors.torch import save_file

        path = Path(path)
        state = state_dict if state_dict is not None else self.state_dict()
        body_state = {k[len("body."):]: v for k, v in state.items() if k.startswith("body.")}
        if hasattr(self.body, "peft_config"):  # LoRA: the merged body (transformers/vLLM load it), the adapter apart
            from rl_core.hf_export import merge_lora_state

            self.body.save_pretrained(path / "adapter", state_dict=body_state, **kw)
            self.body.get_base_model().save_pretrained(path, state_dict=merge_lora_state(body_state,
                                                                                         self.body.peft_config), **kw)
        else:
            self.body.save_pretrained(path, state_dict=body_state, **kw)
        save_file({"weight": state["head.weight"].detach().contiguous().cpu()}, path / HEAD_FILE)
        (path / HEAD_META).write_text(json.dumps({"kind": self.head_kind, "mean": self.mean, "std": self.std}))


class Critic(_ScalarHeadModel):
    """Value model: ``values[:, t]`` is V(state before x_t), shape of ``input_ids``, 0 at t = 0."""

    head_kind = "value"

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                position_ids: Tensor | None = None) -> Tensor:
        v = self.per_token(input_ids, attention_mask, position_ids)
        return _shift_right(v, position_ids if attention_mask is None else None)


class RewardModel(_ScalarHeadModel):
    """Score model: one reward per sequence, read at its last real token (of each packed sequence in a
    packed row, as OpenRLHF's ``--packing_samples`` reads it).

    ``normalize=True`` applies the stored ``(score - mean) / std`` (written by the RM
    trainer over its training set), as OpenRLHF does at inference.
    """

    head_kind = "score"

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, position_ids: Tensor | None = None,
                *, normalize: bool = False) -> Tensor:
        """Padded rows ``[B, T]`` (``attention_mask``; padding left or right) -> ``[B]`` float32. Packed rows
        (``position_ids`` restarting at 0 per sequence, no mask) -> ``[N]``: one score per sequence, in order."""
        if attention_mask is None:
            if position_ids is None:
                raise ValueError("RewardModel needs an attention_mask (padded rows) or position_ids (packed rows) "
                                 "to find each sequence's last token")
            from rl_core.varlen_attention import cu_seqlens  # transformers' own rule for where a sequence starts

            scores_BT = self.per_token(input_ids, position_ids=position_ids)
            edges, _ = cu_seqlens(position_ids, input_ids.shape[0])
            scores_B = scores_BT.reshape(-1)[edges[1:].long() - 1]
        else:
            scores_BT = self.per_token(input_ids, attention_mask)
            idx = torch.arange(attention_mask.shape[1], device=attention_mask.device).expand_as(attention_mask)
            last = torch.where(attention_mask.bool(), idx, -1).max(dim=1).values
            if (last < 0).any():
                raise ValueError(f"RewardModel got rows with no real token (all-zero attention_mask): rows "
                                 f"{torch.nonzero(last < 0).flatten().tolist()}")
            scores_B = scores_BT.gather(1, last.unsqueeze(1)).squeeze(1)
        return (scores_B - self.mean) / self.std if normalize else scores_B
