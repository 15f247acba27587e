"""Mixing datasets by probability (rl_core.data.blending), as OpenRLHF's blending_datasets: the same order as
datasets.interleave_datasets for the same seed, the mixture's proportions on a seeded draw, every row from a
source and every source row in the mixture, max_samples per file then overall, and bad flags in one line."""

from __future__ import annotations

import json

import pytest

from rl_core.data import DataConfig, blend_rows, load_rows, training_rows
from rl_core.data.blending import interleave_order


def write(path, n, tag):
    path.write_text("".join(json.dumps({"input": f"{tag}{i}"}) + "\n" for i in range(n)))
    return str(path)


@pytest.mark.parametrize(("lengths", "probs", "seed"), [([30, 10], [0.7, 0.3], 42), ([5, 40, 12], [0.2, 0.5, 0.3], 7),
                                                        ([1500, 200], [0.9, 0.1], 0)])
def test_order_is_datasets_interleave_all_exhausted(lengths, probs, seed):
    datasets = pytest.importorskip("datasets", reason="the reference is datasets.interleave_datasets")
    parts = [datasets.Dataset.from_dict({"s": [s] * n, "r": list(range(n))}) for s, n in enumerate(lengths)]
    ref = datasets.interleave_datasets(parts, probabilities=probs, seed=seed, stopping_strategy="all_exhausted")
    assert interleave_order(lengths, probs, seed) == list(zip(ref["s"], ref["r"], strict=True))


def test_mixture_follows_the_probabilities_and_holds_every_row_of_every_source(tmp_path):
    a, b = write(tmp_path / "a.jsonl", 3000, "a"), write(tmp_path / "b.jsonl", 1000, "b")
    rows = blend_rows(f"{a},{b}", (0.7, 0.3), seed=3)
    from_a = sum(r.source == a for r in rows)
    assert abs(from_a / len(rows) - 0.7) < 0.02, from_a / len(rows)
    assert {r.source for r in rows} == {a, b}
    # every row is a row of its source (its line number and text agree), and every source row is in the mixture
    assert all(r["input"] == f"{'a' if r.source == a else 'b'}{r.number - 1}" for r in rows)
    assert {(r.source, r.number) for r in rows} == {(a, i) for i in range(1, 3001)} | {(b, i) for i in range(1, 1001)}
    assert blend_rows(f"{a},{b}", (0.7, 0.3), seed=3) == rows  # seeded
    assert blend_rows(f"{a},{b}", (0.7, 0.3), seed=4) != rows


def test_max_samples_caps_each_file_then_the_mixture(tmp_path):
    a, b = write(tmp_path / "a.jsonl", 50, "a"), write(tmp_path / "b.jsonl", 50, "b")
    rows = blend_rows(f"{a},{b}", (0.5, 0.5), max_samples=10, seed=1)
    assert len(rows) == 10
    assert all(r.number <= 10 for r in rows)  # each file's first 10 rows only, as OpenRLHF's max_count
    full = blend_rows(f"{a},{b}", (0.5, 0.5), max_samples=None, seed=1)
    assert len(full) >= 100


def test_training_rows_mixes_only_with_probabilities(tmp_path):
    a, b = write(tmp_path / "a.jsonl", 4, "a"), write(tmp_path / "b.jsonl", 4, "b")
    plain = DataConfig(dataset=f"{a},{b}")
    assert training_rows(plain, seed=0) == load_rows(f"{a},{b}")  # concatenated, as OpenRLHF without probs
    mixed = training_rows(DataConfig(dataset=f"{a},{b}", dataset_probs="0.5,0.5"), seed=0)
    assert mixed == blend_rows(f"{a},{b}", (0.5, 0.5), seed=0) and mixed != load_rows(f"{a},{b}")


@pytest.mark.parametrize(("probs", "message"), [
    ("0.7", r"gives 1 probabilities for 2 --dataset files .*one per file"),
    ("0.7,0.2", r"sums to 0.9; the probabilities must sum to 1.*e.g. 0.7778,0.2222"),
    ("1.2,-0.2", r"every probability must be > 0"),
    ("1,0", r"every probability must be > 0.*drop that file"),
    ("0.7;0.3", r"must be numbers separated by commas"),
])
def test_bad_probabilities_name_the_value_and_the_fix(probs, message):
    with pytest.raises(ValueError, match=message):
        DataConfig(dataset="a.jsonl,b.jsonl", dataset_probs=probs)
