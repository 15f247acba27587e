"""Experience of the RL loop: one typed record per sample (:class:`Experience`), the padded batch made from
them (:class:`ExperienceBatch`), and how items are laid out over data-parallel ranks.

Fields are suffixed by their shape: ``_T`` is one value per token of ``input_ids_T`` (prompt, then response),
aligned like ``Actor.logprobs`` (position t scores token x_t); ``_BT`` the same, right-padded over a batch.
Items travel between the controller and the workers (in-process or through Ray), so they hold plain picklable
values: token ids and masks as lists, per-token floats as CPU float32 tensors.

:func:`collate` right-pads items into an :class:`ExperienceBatch`; :func:`rows` cuts a ``[B, T]`` result back
into per-item tensors. :func:`dp_order` lays items out so that ``call_sharded`` (contiguous shards) gives every
data-parallel rank its slice of *each* global batch: the optimizer steps are then the same whatever the number
of ranks. :func:`ring_shards` repeats each data-parallel shard for the ranks of a ring attention group
(:mod:`rl_core.ring_attention`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch

#: The per-token float fields an item may carry (``<name>_T`` on :class:`Experience`, ``<name>_BT`` on
#: :class:`ExperienceBatch`), in the order the loop fills them.
TokenField = Literal[
    "rollout_logprobs",
    "old_logprobs",
    "ref_logprobs",
    "teacher_logprobs",
    "values",
    "advantages",
    "returns",
    "turn_rewards",
]
TOKEN_FIELDS: tuple[TokenField, ...] = get_args(TokenField)


@dataclass(slots=True)
class Experience:
    """One sample: its tokens and what the loop computed for each of them.

    - ``input_ids_T``, ``prompt_len``, ``loss_mask_T`` (0 on the prompt, the engine's mask on the response:
      an agent's environment tokens are 0 too): from the rollout (:func:`make_item`).
    - ``rollout_logprobs_T``: the engine's log-probs of the sampled tokens (0 on the prompt), when it returned
      them.
    - ``old_logprobs_T`` (the policy before this step's updates), ``ref_logprobs_T`` (the reference model),
      ``teacher_logprobs_T`` (the distillation teacher, :mod:`rl_core.rl.teacher`), ``values_T`` (the critic):
      the experience forwards.
    - ``turn_rewards_T``: an agent's per-turn rewards on each turn's last token (``--agent_turn_rewards``),
      consumed by the advantage step (then None: not the workers' to train on).
    - ``advantages_T``, ``returns_T``: the advantage step (returns with a critic only).
    - ``teacher_topk_ids_RK``, ``teacher_topk_logprobs_RK``: with ``--distill_divergence forward_kl | jsd``, the
      teacher's top ``K`` tokens at each of the ``R = T - prompt_len`` response tokens (:mod:`rl_core.rl.distill_topk`;
      response positions only, laid out for a forward by :func:`rl_core.rl.distill_topk.predicting_layout`).
    - ``image_inputs``: a vision-language prompt's image tensors (``{"pixel_values": ..., ...}``), what the
      engine generated with.
    """

    input_ids_T: list[int]
    prompt_len: int
    loss_mask_T: list[int]
    rollout_logprobs_T: torch.Tensor | None = None
    old_logprobs_T: torch.Tensor | None = None
    ref_logprobs_T: torch.Tensor | None = None
    teacher_logprobs_T: torch.Tensor | None = None
    values_T: torch.Tensor | None = None
    advantages_T: torch.Tensor | None = None
    returns_T: torch.Tensor | None = None
    turn_rewards_T: torch.Tensor | None = None
    teacher_topk_ids_RK: torch.Tensor | None = None
    teacher_topk_logprobs_RK: torch.Tensor | None = None
    image_inputs: dict[str, torch.Tensor] | None = None

    def __post_init__(self) -> None:
        if len(self.loss_mask_T) != len(self.input_ids_T):
            raise ValueError(
                f"an experience item has {len(self.loss_mask_T)} loss-mask entries for {len(self.input_ids_T)} tokens"
            )

    @property
    def T(self) -> int:
        """Tokens in the sequence (prompt and response)."""
        return len(self.input_ids_T)

    def token(self, name: TokenField) -> torch.Tensor | None:
        """The per-token field ``name`` (``"advantages"`` -> ``advantages_T``)."""
        return getattr(self, name + "_T")

    def set_token(self, name: TokenField, value: torch.Tensor | None) -> None:
        if value is not None and len(value) != self.T:
            raise ValueError(f"{name}_T has {len(value)} values for a {self.T}-token item")
        setattr(self, name + "_T", value)


@dataclass(slots=True)
class ExperienceBatch:
    """Items right-padded to ``[B, T]`` (:func:`collate`): ids, attention and loss masks, and the per-token
    fields asked for (0 past each item's end and where an item has none; None where not asked for)."""

    input_ids_BT: torch.Tensor
    attention_mask_BT: torch.Tensor
    loss_mask_BT: torch.Tensor
    rollout_logprobs_BT: torch.Tensor | None = None
    old_logprobs_BT: torch.Tensor | None = None
    ref_logprobs_BT: torch.Tensor | None = None
    teacher_logprobs_BT: torch.Tensor | None = None
    values_BT: torch.Tensor | None = None
    advantages_BT: torch.Tensor | None = None
    returns_BT: torch.Tensor | None = None
    turn_rewards_BT: torch.Tensor | None = None

    def token(self, name: TokenField) -> torch.Tensor:
        """The padded field ``name``; an error naming it when :func:`collate` was not asked for it."""
        t = getattr(self, name + "_BT")
        if t is None:
            raise KeyError(f"this batch was collated without {name!r}: pass it in collate(fields=...)")
        return t

    def to(self, move) -> ExperienceBatch:
        """Every tensor through ``move`` (e.g. ``lambda t: to_device(t, device)``)."""
        moved: dict[str, Any] = {
            f.name: None if (t := getattr(self, f.name)) is None else move(t) for f in dataclasses.fields(self)
        }
        return ExperienceBatch(**moved)


def make_item(
    prompt_ids: Sequence[int],
    response_ids: Sequence[int],
    response_mask: Sequence[int] | None = None,
    rollout_logprobs: Sequence[float] | None = None,
) -> Experience:
    """An item from a rollout sample's prompt and response (mask 1 on every response token by default)."""
    p, r = list(prompt_ids), list(response_ids)
    mask = [1] * len(r) if response_mask is None else [int(m) for m in response_mask]
    if len(mask) != len(r):
        raise ValueError(f"response mask has {len(mask)} entries for {len(r)} response tokens")
    item = Experience(input_ids_T=p + r, prompt_len=len(p), loss_mask_T=[0] * len(p) + mask)
    if rollout_logprobs:
        if len(rollout_logprobs) != len(r):
            raise ValueError(f"{len(rollout_logprobs)} rollout logprobs for {len(r)} response tokens")
        item.rollout_logprobs_T = torch.tensor([0.0] * len(p) + list(rollout_logprobs), dtype=torch.float32)
    return item


def sequence(input_ids: Sequence[int], loss_mask: Sequence[int]) -> Experience:
    """An item from a whole tokenised row (PPO-ptx's pretraining rows: no prompt/response split)."""
    return Experience(input_ids_T=[int(t) for t in input_ids], prompt_len=0, loss_mask_T=[int(m) for m in loss_mask])


def collate(items: Sequence[Experience], pad_id: int, fields: Sequence[TokenField] = ()) -> ExperienceBatch:
    """Right-padded ``input_ids``, ``attention_mask``, ``loss_mask`` and the per-token ``fields`` (0 where an
    item has none)."""
    if not items:
        raise ValueError("collate got no items")
    for name in fields:
        if name not in TOKEN_FIELDS:
            raise ValueError(f"collate: no per-token field {name!r}; the fields are {', '.join(TOKEN_FIELDS)}")
    T = max(it.T for it in items)
    B = len(items)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    attn = torch.zeros(B, T, dtype=torch.long)
    loss = torch.zeros(B, T, dtype=torch.long)
    extra = {name: torch.zeros(B, T, dtype=torch.float32) for name in fields}
    for b, it in enumerate(items):
        n = it.T
        ids[b, :n] = torch.tensor(it.input_ids_T)
        attn[b, :n] = 1
        loss[b, :n] = torch.tensor(it.loss_mask_T)
        for name, out in extra.items():
            x = it.token(name)
            if x is not None:
                out[b, :n] = x
    return ExperienceBatch(ids, attn, loss, **{f"{k}_BT": v for k, v in extra.items()})


def rows(x_BT: torch.Tensor, items: Sequence[Experience]) -> list[torch.Tensor]:
    """Row b of ``x_BT`` cut to item b's length (float32, CPU)."""
    x = x_BT.detach().float().cpu()
    return [x[b, : it.T].clone() for b, it in enumerate(items)]


def dp_order(n: int, global_batch: int, world: int) -> list[int]:
    """Permutation of ``range(n)``: shard r (contiguous, ``n / world`` long) holds slice r of every global batch."""
    if n % global_batch or global_batch % world:
        raise ValueError(
            f"{n} samples must be a multiple of the global batch {global_batch}, itself a multiple "
            f"of the {world} data-parallel ranks"
        )
    local = global_batch // world
    return [
        g * global_batch + r * local + i for r in range(world) for g in range(n // global_batch) for i in range(local)
    ]


def ring_shards(items: Sequence, world: int, ring: int) -> list:
    """``items`` laid out for ``call_sharded`` over ``world`` ranks in ring attention groups of ``ring``
    consecutive ranks: the ``world / ring`` data-parallel shards, each repeated once per rank of its group (they
    compute it together; only the group's first rank returns results, :meth:`rl_core.rl.worker_base._Worker._leader`,
    so the concatenated results line up with ``items``)."""
    if ring == 1:
        return list(items)
    dp = world // ring
    if world % ring or len(items) % dp:
        raise ValueError(
            f"{len(items)} items cannot be split over {dp} data-parallel shards of {world} ranks in "
            f"ring attention groups of {ring}"
        )
    n = len(items) // dp
    return [it for g in range(dp) for _ in range(ring) for it in items[g * n : (g + 1) * n]]
