"""Every call of a per-call agent episode trained (``--agent_cmd``, :mod:`rl_core.trainers.ppo_agent_cmd`):
:class:`EpisodeItems` turns the loop's one item per slot (``prompts x n``) into the items it trains.

An episode whose calls do not extend each other token for token (:mod:`rl_rollout.agents.transcript`,
``per_call``) cannot be one sequence. Its slot's sample is its last call; the earlier calls ride along in
``sample.info["earlier_calls"]`` (plain lists). Here the slot becomes one item per call (the slot's own item
last), and the loop keeps counting *episodes* where it counts samples:

- rewards, dynamic filtering, reward models: the slot's sample, as before (the Sampler never sees the calls);
- advantages: one *episode row* per slot (:meth:`EpisodeItems.episode_rows`), the calls' response tokens end to
  end after the first call's prompt, every per-token field (old / reference / engine log-probs, values) cut from
  the calls' own forwards. The estimator runs on these ``prompts x n`` rows unchanged, so a group baseline (GRPO,
  RLOO, ...) counts each episode once and a scalar estimator gives every sampled token of every call the
  episode's advantage; a token-level one (GAE, REINFORCE++ returns) runs over the calls' sampled tokens in order,
  as over a merged sequence without the tokens between them. :meth:`EpisodeItems.split` copies advantages and
  returns back onto the calls' items;
- training: global batches stay ``train_batch_size`` *episodes* (the optimizer steps per iteration and the
  on-policy shortcut are unchanged); a global batch holds its episodes' calls, a rank its slice of the episodes'
  calls, every rank's slice padded to one length ``L`` with items of no loss token (:func:`train_layout`; the
  workers take ``local_batch=L``). The token-mean losses divide by the global batch's loss tokens, so each
  call's sampled tokens weigh what they would in a merged sequence. The seq-mean aggregations count a call as a
  sequence (normalised by the episodes of the global batch).

Without per-call episodes every method is the identity of the loop before (one item per slot, ``dp_order``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rl_core.rl.experience import TOKEN_FIELDS, Experience, make_item

#: ``RolloutSample.info`` key of a per-call episode's calls before its last (:mod:`rl_core.trainers.ppo_agent_cmd`):
#: dicts of ``prompt_ids``, ``response_ids``, ``loss_mask``, ``rollout_logprobs``.
EARLIER_CALLS = "earlier_calls"


@dataclass
class EpisodeItems:
    """``items``: every slot's items in slot order (a per-call episode's calls in order, the slot's own item
    last); ``slot_of[i]``: the slot of ``items[i]``; ``slots``: the slot count; ``added``: items beyond one per
    slot."""

    items: list[Experience]
    slot_of: list[int]
    slots: int

    @property
    def added(self) -> int:
        return len(self.items) - self.slots

    @classmethod
    def of(cls, samples: Sequence, items: Sequence[Experience]) -> EpisodeItems:
        """The slots' items (``items[b]`` made from ``samples[b]``) with each per-call episode's earlier calls."""
        out: list[Experience] = []
        slot_of: list[int] = []
        for b, (s, item) in enumerate(zip(samples, items, strict=True)):
            for c in s.info.get(EARLIER_CALLS, ()):
                out.append(make_item(c["prompt_ids"], c["response_ids"], c["loss_mask"], c["rollout_logprobs"]))
                slot_of.append(b)
            out.append(item)
            slot_of.append(b)
        return cls(out, slot_of, len(items))

    def expand(self, per_slot: Sequence) -> list:
        """A per-slot list (e.g. the async ``fresh`` flags) per item."""
        return [per_slot[b] for b in self.slot_of]

    def padded(self, multiple: int, pad_id: int) -> list[Experience]:
        """``items`` and items of no loss token up to a multiple of ``multiple`` (the forwards' data-parallel shards)."""
        return self.items + [pad_item(pad_id) for _ in range(-len(self.items) % multiple)]

    def episode_rows(self) -> list[Experience]:
        """One row per slot: the first item's prompt, then each item's response tokens in order, every per-token
        field the items carry cut the same way (the items themselves when no slot has several)."""
        if not self.added:
            return self.items
        by_slot = self._by_slot()
        rows = []
        for idx in by_slot:
            parts = [self.items[i] for i in idx]
            head = parts[0]
            cut = [head.prompt_len] + [p.prompt_len for p in parts[1:]]
            row = Experience(
                input_ids_T=head.input_ids_T[: cut[0]]
                + [t for p, c in zip(parts, cut, strict=True) for t in p.input_ids_T[c:]],
                prompt_len=cut[0],
                loss_mask_T=head.loss_mask_T[: cut[0]]
                + [m for p, c in zip(parts, cut, strict=True) for m in p.loss_mask_T[c:]],
            )
            for name in TOKEN_FIELDS:
                xs = [x for p in parts if (x := p.token(name)) is not None]
                if len(xs) == len(parts):  # a field some calls lack is left out of the row (collate: 0)
                    row.set_token(name, torch.cat([xs[0][: cut[0]]] + [x[c:] for x, c in zip(xs, cut, strict=True)]))
            rows.append(row)
        return rows

    def split(self, rows: Sequence[Experience]) -> None:
        """Advantages and returns of the episode rows onto the items (0 on each item's prompt)."""
        if rows is self.items:
            return
        for idx, row in zip(self._by_slot(), rows, strict=True):
            start = row.prompt_len
            for i in idx:
                item = self.items[i]
                n = item.T - item.prompt_len
                for name in ("advantages", "returns"):
                    x = row.token(name)
                    if x is not None:
                        item.set_token(name, torch.cat([torch.zeros(item.prompt_len), x[start : start + n]]))
                start += n

    def train_order(self, global_batch: int, world: int, pad_id: int) -> tuple[list[Experience], int]:
        """The items laid out for a group's ``train`` over ``world`` data-parallel ranks (:func:`train_layout`)
        and the local batch ``L`` each rank's slice of a global batch holds."""
        order, local = train_layout(self.slot_of, self.slots, global_batch, world)
        return [self.items[i] if i is not None else pad_item(pad_id) for i in order], local

    def _by_slot(self) -> list[list[int]]:
        return items_by_slot(self.slot_of, self.slots)


def items_by_slot(slot_of: Sequence[int], slots: int) -> list[list[int]]:
    """The item indices of each slot, in order."""
    by_slot: list[list[int]] = [[] for _ in range(slots)]
    for i, b in enumerate(slot_of):
        by_slot[b].append(i)
    return by_slot


def train_layout(slot_of: Sequence[int], slots: int, global_batch: int, world: int) -> tuple[list[int | None], int]:
    """Indices of the items (None: a padding item) so that ``call_sharded``'s contiguous shard ``r`` holds, for
    each global batch of ``global_batch`` slots in turn, the items of its slots ``r * local .. (r + 1) * local``
    (``local = global_batch / world``), padded to the longest such slice ``L``; returns ``(order, L)``. One item
    per slot: :func:`~rl_core.rl.experience.dp_order` and ``L = local``."""
    if slots % global_batch or global_batch % world:
        raise ValueError(
            f"{slots} samples must be a multiple of the global batch {global_batch}, itself a multiple "
            f"of the {world} data-parallel ranks"
        )
    local = global_batch // world
    by_slot = items_by_slot(slot_of, slots)
    nb = slots // global_batch
    shards = [
        [
            [i for s in range(g * global_batch + r * local, g * global_batch + (r + 1) * local) for i in by_slot[s]]
            for g in range(nb)
        ]
        for r in range(world)
    ]
    L = max(len(x) for per_rank in shards for x in per_rank)
    order: list[int | None] = [i for per_rank in shards for x in per_rank for i in x + [None] * (L - len(x))]
    return order, L


def pad_item(pad_id: int) -> Experience:
    """An item of no loss token (two pad ids, mask 0): it fills a rank's slice, trains nothing, counts no token."""
    item = make_item([pad_id], [pad_id], [0], [0.0])
    item.advantages_T = torch.zeros(2)
    return item
