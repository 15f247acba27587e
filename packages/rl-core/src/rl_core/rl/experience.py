"""Experience items of the RL loop: one dict per sample, and the padded batches made from them.

An *item* is what travels between the controller and the workers (in-process or
through Ray, so plain picklable values)::

    {"input_ids": [prompt + response token ids], "prompt_len": int,
     "loss_mask": [0 on the prompt, the engine's loss mask on the response],
     # per-token float tensors of len(input_ids), aligned like Actor.logprobs (t = x_t):
     "old_logprobs", "ref_logprobs", "values", "advantages", "returns", "rollout_logprobs",
     # a vision-language prompt's image tensors ({"pixel_values": ..., ...}), what the engine generated with:
     "image_inputs"}

:func:`collate` right-pads items into ``[B, T]`` tensors; :func:`rows` cuts a
``[B, T]`` result back into per-item tensors. :func:`dp_order` lays items out so
that ``call_sharded`` (contiguous shards) gives every data-parallel rank its slice
of *each* global batch: the optimizer steps are then the same whatever the number
of ranks. :func:`ring_shards` repeats each data-parallel shard for the ranks of a
ring attention group (:mod:`rl_core.ring_attention`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

TOKEN_KEYS = ("old_logprobs", "ref_logprobs", "values", "advantages", "returns", "rollout_logprobs")


def make_item(prompt_ids: Sequence[int], response_ids: Sequence[int], response_mask: Sequence[int] | None = None,
              rollout_logprobs: Sequence[float] | None = None) -> dict:
    """An item from a rollout sample's prompt and response (mask 1 on every response token by default)."""
    p, r = list(prompt_ids), list(response_ids)
    mask = [1] * len(r) if response_mask is None else [int(m) for m in response_mask]
    if len(mask) != len(r):
        raise ValueError(f"response mask has {len(mask)} entries for {len(r)} response tokens")
    item = {"input_ids": p + r, "prompt_len": len(p), "loss_mask": [0] * len(p) + mask}
    if rollout_logprobs:
        if len(rollout_logprobs) != len(r):
            raise ValueError(f"{len(rollout_logprobs)} rollout logprobs for {len(r)} response tokens")
        item["rollout_logprobs"] = torch.tensor([0.0] * len(p) + list(rollout_logprobs), dtype=torch.float32)
    return item


def collate(items: Sequence[dict], pad_id: int, keys: Sequence[str] = ()) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids``, ``attention_mask``, ``loss_mask`` and the per-token ``keys`` (0 where absent)."""
    if not items:
        raise ValueError("collate got no items")
    T = max(len(it["input_ids"]) for it in items)
    B = len(items)
    out = {"input_ids": torch.full((B, T), pad_id, dtype=torch.long),
           "attention_mask": torch.zeros(B, T, dtype=torch.long),
           "loss_mask": torch.zeros(B, T, dtype=torch.long)}
    for k in keys:
        out[k] = torch.zeros(B, T, dtype=torch.float32)
    for b, it in enumerate(items):
        n = len(it["input_ids"])
        out["input_ids"][b, :n] = torch.tensor(it["input_ids"])
        out["attention_mask"][b, :n] = 1
        out["loss_mask"][b, :n] = torch.tensor(it["loss_mask"])
        for k in keys:
            if k in it:
                out[k][b, :n] = it[k]
    return out


def rows(x_BT: torch.Tensor, items: Sequence[dict]) -> list[torch.Tensor]:
    """Row b of ``x_BT`` cut to item b's length (float32, CPU)."""
    x = x_BT.detach().float().cpu()
    return [x[b, :len(it["input_ids"])].clone() for b, it in enumerate(items)]


def dp_order(n: int, global_batch: int, world: int) -> list[int]:
    """Permutation of ``range(n)``: shard r (contiguous, ``n / world`` long) holds slice r of every global batch."""
    if n % global_batch or global_batch % world:
        raise ValueError(f"{n} samples must be a multiple of the global batch {global_batch}, itself a multiple "
                         f"of the {world} data-parallel ranks")
    local = global_batch // world
    return [g * global_batch + r * local + i for r in range(world) for g in range(n // global_batch)
            for i in range(local)]


def ring_shards(items: Sequence, world: int, ring: int) -> list:
    """``items`` laid out for ``call_sharded`` over ``world`` ranks in ring attention groups of ``ring``
    consecutive ranks: the ``world / ring`` data-parallel shards, each repeated once per rank of its group (they
    compute it together; only the group's first rank returns results, :meth:`rl_core.rl.workers._Worker._leader`,
    so the concatenated results line up with ``items``)."""
    if ring == 1:
        return list(items)
    dp = world // ring
    if world % ring or len(items) % dp:
        raise ValueError(f"{len(items)} items cannot be split over {dp} data-parallel shards of {world} ranks in "
                         f"ring attention groups of {ring}")
    n = len(items) // dp
    return [it for g in range(dp) for _ in range(ring) for it in items[g * n:(g + 1) * n]]
