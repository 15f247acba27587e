"""Mixing several datasets by probability, as OpenRLHF's ``blending_datasets`` does (``--dataset a,b
--dataset_probs 0.7,0.3``; ``--prompt_data`` / ``--prompt_data_probs`` in RL).

OpenRLHF (``openrlhf/datasets/utils.py``) reads each comma-separated dataset (its ``--dataset_split``), keeps
at most ``max_samples`` rows of each, and then, with probabilities, calls ``datasets.interleave_datasets(...,
probabilities, seed=--seed, stopping_strategy="all_exhausted")``: a seeded draw picks the source of each next
row; a source that runs out starts over; the mixture ends once every source has given all its rows at least
once (so the scarce sources set its length, and the others repeat). The caller then keeps the first
``max_samples`` rows of the mixture. Without probabilities the datasets are concatenated
(:func:`rl_core.data.loading.load_rows`).

:func:`interleave_order` draws the same order as ``datasets`` 5's ``interleave_datasets`` for the same seed
(numpy's ``default_rng(seed).choice`` in blocks of 1000; tests compare the two), over our rows, which keep
their file and line for error messages. Leaves out the other stopping strategies (OpenRLHF uses only this one).
"""

from __future__ import annotations

import numpy as np

from rl_core.data.loading import Row, _split_paths, load_rows

BLOCK = 1000  # datasets draws the sources in blocks of this many; the same blocks give the same order


def interleave_order(lengths: list[int], probs: list[float], seed: int) -> list[tuple[int, int]]:
    """``(source, row)`` of each row of the mixture: ``datasets.interleave_datasets(probabilities=probs,
    seed=seed, stopping_strategy="all_exhausted")`` over sources of ``lengths`` rows. Every probability > 0,
    every length > 0, probabilities summing to 1 (:class:`rl_core.data.config.DataConfig` checks the flags)."""
    n = len(lengths)
    if abs(sum(probs) - 1) > 1e-8:  # within DataConfig's 1e-6 but past numpy's tolerance: rescale, do not fail
        probs = [p / sum(probs) for p in probs]
    rng = np.random.default_rng(seed)
    blocks, counts = [], np.zeros(n, dtype=np.int64)
    while not (counts >= lengths).all():
        block = rng.choice(n, size=BLOCK, p=probs)
        blocks.append(block)
        counts += np.bincount(block, minlength=n)
    draws = np.concatenate(blocks)
    # the mixture ends at the draw that gives the last source its last unseen row
    stop = max(np.flatnonzero(draws == s)[lengths[s] - 1] for s in range(n))
    used = draws[: stop + 1]
    rows = np.empty(len(used), dtype=np.int64)
    for s in range(n):
        pos = np.flatnonzero(used == s)
        rows[pos] = np.arange(len(pos)) % lengths[s]  # a source that ran out starts over
    return list(zip(used.tolist(), rows.tolist(), strict=True))


def blend_rows(
    path: str,
    probs: tuple[float, ...],
    *,
    split: str = "train",
    max_samples: int | None = None,
    seed: int = 42,
    skip_bad: bool = False,
) -> list[Row]:
    """OpenRLHF's ``blending_datasets`` with probabilities, then its cut to ``max_samples``: the rows of the
    comma-separated datasets of ``path`` (each its first ``max_samples``), mixed by ``probs``."""
    paths = _split_paths(path)
    if len(paths) != len(probs):
        raise ValueError(f"{len(probs)} probabilities for {len(paths)} datasets ({path!r}); give one per dataset")
    sources = [load_rows(p, split, max_samples, skip_bad=skip_bad) for p in paths]
    order = interleave_order([len(rows) for rows in sources], list(probs), seed)
    return [sources[s][r] for s, r in order[:max_samples]]


def training_rows(cfg, seed: int) -> list[Row]:
    """The rows of ``cfg.dataset`` (a :class:`DataConfig`): mixed by ``cfg.dataset_probs`` (seeded by the run's
    ``seed``, as OpenRLHF's ``--seed``) when given, else concatenated."""
    if cfg.dataset_probs is None:
        return load_rows(cfg.dataset, cfg.split, cfg.max_samples, skip_bad=cfg.skip_bad_rows)
    return blend_rows(
        cfg.dataset,
        cfg.probabilities,
        split=cfg.split,
        max_samples=cfg.max_samples,
        seed=seed,
        skip_bad=cfg.skip_bad_rows,
    )
