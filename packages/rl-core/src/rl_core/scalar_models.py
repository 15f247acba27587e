"""The models that give one number per position: :class:`Critic` (values) and :class:`RewardModel` (a score
per sequence), a transformer body plus a linear head saved beside it (``rl_head.safetensors`` and
``rl_head.json``), and OpenRLHF's reward and critic folders read as they are. Same alignment convention as
:mod:`rl_core.models`."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rl_core.hf_export import merge_lora_state
from rl_core.model_loading import HEAD_FILE, HEAD_META, LoraSpec, _check_folder, _load, _openrlhf_head
from rl_core.model_rows import _positions, _repad, _ring_padded, _ring_slice, _shift_right, _unpad
from rl_core.qlora import Load4bitConfig, saving_unquantized
from rl_core.varlen_attention import cu_seqlens

logger = logging.getLogger(__name__)
Tensor = torch.Tensor


class _ScalarHeadModel(nn.Module):
    """A transformer body plus a linear head giving one number per position."""

    head_kind = "value"

    # ``body``: a transformers AutoModel, or a peft model around one (its attributes forward to it): typed Any,
    # since nn.Module's stubs give every attribute as Tensor | Module
    def __init__(self, body: Any, head: nn.Linear | None = None, mean: float = 0.0, std: float = 1.0):
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
        value_head_prefix: str | None = None,
        require_head: bool = False,
        experts_implementation: str | None = None,
        load_in_4bit: Load4bitConfig | None = None,
    ):
        """Load the body from ``path`` and its head: ours (``rl_head.safetensors``, what rl rm writes), else
        OpenRLHF's (``<value_head_prefix>.weight`` in the model's own weights, the prefix from its config.json or
        ``score``; mean and std from config.json, as OpenRLHF's reward models keep them), else a fresh head, which
        ``require_head`` refuses (a reward model that scores: a random head would reward noise). A critic starts
        from a reward model's score head, as OpenRLHF's does. ``use_liger_kernel`` and ``packed`` as for
        :meth:`Actor.from_pretrained`."""
        from safetensors.torch import load_file
        from transformers import AutoModel

        path = _check_folder(path)
        body = _load(
            AutoModel,
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
        head, mean, std = None, 0.0, 1.0
        kinds = ("value", "score") if cls.head_kind == "value" else (cls.head_kind,)
        prefix = value_head_prefix or getattr(body.config, "value_head_prefix", None) or "score"
        if (path / HEAD_META).is_file():
            meta = json.loads((path / HEAD_META).read_text())
            if meta.get("kind") not in kinds:
                raise ValueError(
                    f"{path} holds a {meta.get('kind')!r} head, but {cls.__name__} needs a "
                    f"{cls.head_kind!r} head; load it with the matching class"
                )
            head = nn.Linear(body.config.hidden_size, 1, bias=False)
            head.load_state_dict(load_file(path / HEAD_FILE))
            mean, std = meta.get("mean", 0.0), meta.get("std", 1.0)
            if meta.get("kind") != cls.head_kind:
                logger.info("%s: head initialised from %s's %s head", cls.__name__, path, meta.get("kind"))
        elif (weight := _openrlhf_head(path, prefix)) is not None:
            head = nn.Linear(body.config.hidden_size, 1, bias=False)
            head.load_state_dict({"weight": weight.reshape(1, -1)})
            mean, std = float(getattr(body.config, "mean", 0.0)), float(getattr(body.config, "std", 1.0))
            logger.info(
                "%s: %s is an OpenRLHF-style model: head %s.weight, mean %g, std %g",
                cls.__name__,
                path,
                prefix,
                mean,
                std,
            )
        elif require_head:
            raise ValueError(
                f"{path} holds no {cls.head_kind} head: no {HEAD_META} (rl rm's) and no "
                f"{prefix}.weight in its weights (OpenRLHF's); it is not a trained reward model. Train "
                f"one with rl rm, or give --value_head_prefix if its head has another name"
            )
        else:
            logger.info("%s: %s has no %s head, starting a fresh one", cls.__name__, path, cls.head_kind)
        return cls(body, head, mean, std)

    def hidden(self, input_ids, attention_mask=None, position_ids=None) -> Tensor:
        if position_ids is None and attention_mask is not None:
            position_ids = _positions(attention_mask)
        return self.body(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state

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
        body_state = {k[len("body.") :]: v for k, v in state.items() if k.startswith("body.")}
        if hasattr(self.body, "peft_config"):  # LoRA: the merged body (transformers/vLLM load it), the adapter apart
            self.body.save_pretrained(path / "adapter", state_dict=body_state, **kw)
            with saving_unquantized(self.body.get_base_model()) as base:  # QLoRA: the full weights, unquantized
                base.save_pretrained(path, state_dict=merge_lora_state(body_state, self.body.peft_config), **kw)
        else:
            self.body.save_pretrained(path, state_dict=body_state, **kw)
        save_file({"weight": state["head.weight"].detach().contiguous().cpu()}, path / HEAD_FILE)
        (path / HEAD_META).write_text(json.dumps({"kind": self.head_kind, "mean": self.mean, "std": self.std}))


class Critic(_ScalarHeadModel):
    """Value model: ``values[:, t]`` is V(state before x_t), shape of ``input_ids``, 0 at t = 0."""

    head_kind = "value"

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, position_ids: Tensor | None = None
    ) -> Tensor:
        v = self.per_token(input_ids, attention_mask, position_ids)
        return _shift_right(v, position_ids if attention_mask is None else None)


class RewardModel(_ScalarHeadModel):
    """Score model: one reward per sequence, read at its last real token (of each packed sequence in a
    packed row, as OpenRLHF's ``--packing_samples`` reads it).

    ``normalize=True`` applies the stored ``(score - mean) / std`` (written by the RM
    trainer over its training set), as OpenRLHF does at inference.
    """

    head_kind = "score"

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        *,
        normalize: bool = False,
    ) -> Tensor:
        """Padded rows ``[B, T]`` (``attention_mask``; padding left or right) -> ``[B]`` float32. Packed rows
        (``position_ids`` restarting at 0 per sequence, no mask) -> ``[N]``: one score per sequence, in order."""
        if attention_mask is None:
            if position_ids is None:
                raise ValueError(
                    "RewardModel needs an attention_mask (padded rows) or position_ids (packed rows) "
                    "to find each sequence's last token"
                )

            scores_BT = self.per_token(input_ids, position_ids=position_ids)
            edges, _ = cu_seqlens(position_ids, input_ids.shape[0])
            scores_B = scores_BT.reshape(-1)[edges[1:].long() - 1]
        else:
            scores_BT = self.per_token(input_ids, attention_mask)
            idx = torch.arange(attention_mask.shape[1], device=attention_mask.device).expand_as(attention_mask)
            last = torch.where(attention_mask.bool(), idx, -1).max(dim=1).values
            if (last < 0).any():
                raise ValueError(
                    f"RewardModel got rows with no real token (all-zero attention_mask): rows "
                    f"{torch.nonzero(last < 0).flatten().tolist()}"
                )
            scores_B = scores_BT.gather(1, last.unsqueeze(1)).squeeze(1)
        return (scores_B - self.mean) / self.std if normalize else scores_B
