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

Where the parts live: Actor here; Critic and RewardModel in :mod:`rl_core.scalar_models`; loading (folder
checks, dtype, attention, liger, LoRA) in :mod:`rl_core.model_loading`; the per-token row layout in
:mod:`rl_core.model_rows`. Every name importable from here before still is.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rl_algos import (
    LogprobsEntropy,
    logprobs_and_entropy_from_logits,
    logprobs_from_hidden,
    logprobs_from_logits,
    weighted_logprob_sum_from_hidden,
)
from rl_core.hub import ModelNotFoundError, resolve_model, resolve_models  # model args resolve here too
from rl_core.model_loading import HEAD_FILE, HEAD_META, LoraSpec, _check_folder, _load, _lora, check_moe_aux_loss
from rl_core.model_rows import _positions, _repad, _ring_padded, _ring_slice, _shift_right, _unpad
from rl_core.qlora import Load4bitConfig
from rl_core.scalar_models import Critic, RewardModel
from rl_rollout.vision import causal_lm_class, is_vision_config, placeholder_token_ids, token_types

__all__ = [
    "HEAD_FILE",
    "HEAD_META",
    "Actor",
    "ActorOutput",
    "Critic",
    "LoraSpec",
    "ModelNotFoundError",
    "RewardModel",
    "check_fused_lm_head",
    "check_moe_aux_loss",
    "frozen",
    "resolve_model",
    "resolve_models",
]

logger = logging.getLogger(__name__)
Tensor = torch.Tensor


# causal LMs whose logits are exactly lm_head(decoder(...).last_hidden_state) in transformers (Actor.enable_fused_lm_head)
FUSED_LM_HEAD_MODELS = frozenset({"llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral"})


def check_fused_lm_head(fused_lm_head: bool | None, strategy_cfg) -> None:
    """Before any model loads: the fused head reads the LM head's weight outside the head's own forward, where
    ZeRO-3 keeps it partitioned."""
    if fused_lm_head and strategy_cfg.zero_stage == 3:
        raise ValueError(
            "--fused_lm_head with --zero_stage 3 is not built: ZeRO-3 gathers the LM head's weight only "
            "inside the head's own forward, which the fused path skips; use --zero_stage 0, 1 or 2, or "
            "drop --fused_lm_head"
        )


@dataclass
class ActorOutput:
    logprobs: Tensor  # [B, T] float32, logprobs[:, t] = log p(x_t | x_<t), 0 at t = 0
    entropy: Tensor | None = None  # [B, T] entropy of the distribution that produced x_t
    aux_loss: Tensor | None = None  # [] the MoE router's load-balancing loss (Actor.enable_moe_aux_loss)
    weighted: Tensor | None = None  # [] sum(lp_weights * logprobs) when the forward was given lp_weights
    # [B, T, V] with return_logits: the model's logits as computed, not shifted (logits[:, t] is the distribution
    # of x_{t+1}; rl_core.model_rows.align_to_tokens moves a per-position value of them onto x_{t+1}'s place)
    logits: Tensor | None = None


class Actor(nn.Module):
    """A causal LM that returns per-token logprobs of its input (see the module's convention)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        # a transformers causal LM, or a peft model around one (its attributes forward to it): typed Any, since
        # nn.Module's stubs give every attribute as Tensor | Module
        self.model: Any = model
        self.moe_aux_loss = False  # enable_moe_aux_loss(): forwards return the router's load-balancing loss
        self.fused_lm_head = False  # enable_fused_lm_head(): log-probs from the hidden states, chunk by chunk

        # a VLM's image placeholders: the engines never sample them, so the log-probs leave them out too
        self._placeholders = placeholder_token_ids(model.config)

    @property
    def is_vlm(self) -> bool:
        """A vision-language model: its forward takes image tensors (:mod:`rl_rollout.vision`)."""

        return is_vision_config(self.config)

    def freeze_visual_encoder(self) -> int:
        """OpenRLHF's ``--freeze_visual_encoder``: every parameter outside the language model and the LM head (the
        vision tower, the projector) stops training; returns how many tensors were frozen. A text-only model
        raises: the flag would do nothing."""
        if not self.is_vlm:
            raise ValueError(
                f"--freeze_visual_encoder freezes a vision-language model's vision tower, but the "
                f"policy ({self.config.model_type}) has none; drop --freeze_visual_encoder"
            )
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
            refuse(
                f"model type {model_type!r} is not one whose logits are exactly lm_head(hidden) here (built for "
                f"{', '.join(sorted(FUSED_LM_HEAD_MODELS))})"
            )
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
            raise ValueError(
                "--fused_lm_head with ZeRO-3 (--zero_stage 3) is not built: the head's weight is "
                "partitioned and gathered only inside its own forward; drop --fused_lm_head or use "
                "--zero_stage 0, 1 or 2"
            )
        return head

    def _fused_logprobs(self, hidden: Tensor, labels: Tensor, temperature: float, entropy: bool):
        head = self._head()
        out = logprobs_from_hidden(
            hidden, head.weight, labels, bias=head.bias, temperature=temperature, return_entropy=entropy
        )
        return (out.logprobs, out.entropy) if isinstance(out, LogprobsEntropy) else (out, None)  # (as entropy asked)

    def _fused_weighted(
        self, hidden: Tensor, labels: Tensor, lp_weights_BT: Tensor, pos_for_shift: Tensor | None, temperature: float
    ) -> tuple[Tensor, Tensor]:
        """``(sum(w * lp), lp)`` with the gradients made in forward. The weights sit on the output's positions
        (``lp_BT[:, t]`` predicts token t); the kernel's row t predicts token t + 1, so they move one to the left;
        the last row's wrapped-around label and, in packed rows, the rows that predict a sequence's first token
        (``_shift_right`` drops their log-probs) weigh nothing."""

        head = self._head()
        w = lp_weights_BT.float()
        if pos_for_shift is not None:
            w = w.masked_fill(pos_for_shift == 0, 0.0)
        w = torch.roll(w, -1, dims=1)
        w[:, -1] = 0.0
        return weighted_logprob_sum_from_hidden(hidden, head.weight, labels, w, bias=head.bias, temperature=temperature)

    def enable_moe_aux_loss(self) -> None:
        """Every forward returns ``aux_loss``: the router's load-balancing loss of a mixture-of-experts model
        (transformers computes it from the router logits, over the real tokens of the batch). A model without a
        router (no ``output_router_logits`` in its config) raises: a coefficient on it would do nothing."""
        check_moe_aux_loss(self.config)
        if self.fused_lm_head:
            raise ValueError(
                "--aux_loss_coef with --fused_lm_head: the MoE load-balancing loss needs the router "
                "logits of the full forward, which the fused head skips; drop one of the two"
            )
        self.moe_aux_loss = True

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        dtype: str = "bf16",
        attn_implementation: str | None = None,
        gradient_checkpointing: bool = False,
        lora: LoraSpec | None = None,
        use_liger_kernel: bool = False,
        packed: bool = False,
        freeze_visual_encoder: bool = False,
        experts_implementation: str | None = None,
        fused_lm_head: bool = False,
        load_in_4bit: Load4bitConfig | None = None,
    ) -> Actor:
        """``use_liger_kernel``: liger-kernel's fused RMSNorm / SwiGLU / RoPE (CUDA; rl_core.liger). ``packed``: the
        model will see packed rows (the default attention is then torch_varlen where it runs: rl_core.attention).
        A vision-language folder loads as ``AutoModelForImageTextToText``; ``freeze_visual_encoder``: see
        :meth:`freeze_visual_encoder` (before LoRA wraps the model). ``fused_lm_head``: see
        :meth:`enable_fused_lm_head`. ``load_in_4bit``: the base weights in 4 bits (QLoRA: :mod:`rl_core.qlora`)."""

        auto_cls = causal_lm_class(_check_folder(path))
        if not freeze_visual_encoder:
            actor = cls(
                _load(
                    auto_cls,
                    path,
                    dtype,
                    attn_implementation,
                    gradient_checkpointing,
                    lora,
                    use_liger_kernel,
                    packed,
                    experts_implementation,
                    load_in_4bit,
                )
            )
        else:
            actor = cls(
                _load(
                    auto_cls,
                    path,
                    dtype,
                    attn_implementation,
                    gradient_checkpointing,
                    None,
                    use_liger_kernel,
                    packed,
                    experts_implementation,
                    load_in_4bit,
                )
            )
            actor.freeze_visual_encoder()
            if lora is not None and lora.rank > 0:
                actor.model = _lora(actor.model, lora, language_model_only=True)
        if fused_lm_head:
            actor.enable_fused_lm_head()
        return actor

    @property
    def config(self):
        return self.model.config

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        *,
        temperature: float = 1.0,
        return_entropy: bool = False,
        lp_weights: Tensor | None = None,
        return_logits: bool = False,
        **images: Tensor,
    ) -> ActorOutput:
        """``images``: a vision-language model's image tensors of the batch (``pixel_values`` ...), padded rows
        only; the model then computes its own positions (multimodal RoPE) from the right-padded mask.

        ``lp_weights`` (``[B, T]`` like the log-probs, constants): the output's ``weighted`` is
        ``sum(lp_weights * logprobs)``, a loss linear in the log-probs (SFT's NLL). With the fused head its
        gradients are computed during forward (:func:`rl_algos.weighted_logprob_sum_from_hidden`: no recompute
        in backward) and ``logprobs`` are values only; use ``weighted`` for the loss.

        ``return_logits``: the output's ``logits`` are the model's ``[B, T, V]`` logits, unshifted and at temperature
        1 (knowledge distillation, :mod:`rl_core.trainers.sft_kd`); not with the fused head (it never holds them) nor
        ring attention (each rank holds a slice)."""
        if return_logits and (self.fused_lm_head or (attention_mask is not None and _ring_padded(attention_mask))):
            raise ValueError(
                "return_logits: the fused LM head never holds the logits whole and ring attention holds a slice of "
                "them per rank; drop --fused_lm_head / use --ring_attn_size 1"
            )
        if images and (attention_mask is None or _ring_padded(attention_mask)):
            raise ValueError(
                "packed rows with images are not built (nor ring attention): run vision-language "
                "prompts without --packing and with --ring_attn_size 1"
            )
        # ring attention computes packed rows: pack, run, put back (_ring_padded: a mask is given)
        if attention_mask is not None and _ring_padded(attention_mask):
            ids, pos, idx = _unpad(input_ids, attention_mask)
            o = self.forward(ids, position_ids=pos, temperature=temperature, return_entropy=return_entropy)
            ent = None if o.entropy is None else _repad(o.entropy, idx, input_ids.shape)
            lp_BT = _repad(o.logprobs, idx, input_ids.shape)
            return ActorOutput(lp_BT, ent, o.aux_loss, None if lp_weights is None else (lp_BT * lp_weights).sum())
        if images:
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
        raw_logits = None
        with _ring_slice(input_ids, attention_mask, position_ids) as shard:
            if shard is not None and return_logits:
                raise ValueError(
                    "return_logits: ring attention holds a slice of the logits per rank; use --ring_attn_size 1"
                )
            if shard is not None:  # ring attention: this rank's slice of the row (labels cut after the roll)
                if self.moe_aux_loss:
                    raise ValueError(
                        "the MoE load-balancing loss is not built with ring attention (each rank "
                        "sees a slice of the router's tokens): drop --aux_loss_coef or use "
                        "--ring_attn_size 1"
                    )
                input_ids, position_ids, labels = (shard.local(input_ids, 0), shard.positions, shard.local(labels, 0))
            aux = weighted = None
            if self.fused_lm_head:  # the head and the log-probs together, chunk by chunk: no [B, T, V] logits
                hidden = self._hidden(
                    input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
                )
                if lp_weights is not None and shard is None and not return_entropy:  # gradients in forward
                    weighted, lp = self._fused_weighted(hidden, labels, lp_weights, pos_for_shift, temperature)
                    ent = None
                else:
                    lp, ent = self._fused_logprobs(hidden, labels, temperature, return_entropy)
            else:
                out = self.model(
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    position_ids=position_ids,
                    use_cache=False,
                    **moe,
                    **images,
                )
                ent, logits, aux = None, out.logits, out.aux_loss if self.moe_aux_loss else None
                if self._placeholders:  # the distribution the engine sampled from: no image placeholder (-1e4: no
                    ids = torch.tensor(self._placeholders, device=logits.device)  # inf: the entropy stays finite)
                    logits = logits.index_fill(-1, ids, -1e4)
                raw_logits = logits if return_logits else None
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
        return ActorOutput(lp_BT, ent_BT, aux, weighted, raw_logits)

    def save_pretrained(self, path: str | Path, state_dict: dict[str, Tensor] | None = None, **kw) -> None:
        self.model.save_pretrained(path, state_dict=state_dict, **kw)


def frozen(actor: Actor) -> Actor:
    """The reference model: the same network with gradients off and in eval mode."""
    for p in actor.parameters():
        p.requires_grad_(False)
    return actor.eval()
