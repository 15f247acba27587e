"""rl_core.preflight's tokenizer loading: OpenRLHF's --disable_fast_tokenizer (use_fast=False) loads."""

from __future__ import annotations

from rl_core.preflight import load_tokenizer


def test_use_fast_false_loads_a_tokenizer_that_encodes_the_same(tmp_path):
    from rl_rollout.testing import make_tokenizer

    make_tokenizer().save_pretrained(tmp_path)
    fast, slow = load_tokenizer(str(tmp_path)), load_tokenizer(str(tmp_path), use_fast=False)
    text = "Repeat the letter a:\n"
    assert slow("x")["input_ids"] and slow(text)["input_ids"] == fast(text)["input_ids"]
    assert slow.pad_token is not None
