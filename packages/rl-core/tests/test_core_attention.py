"""The attention switch: sdpa without flash-attn, a clear error when flash is forced, and a
tiny model really loads and runs with the chosen implementation."""

import importlib.util
import logging

import pytest
import torch

from rl_core.attention import attention_implementation

HAS_FLASH = importlib.util.find_spec("flash_attn") is not None


def test_default_choice_matches_what_is_installed(caplog):
    with caplog.at_level(logging.INFO, logger="rl_core.attention"):
        choice = attention_implementation()
    assert choice == ("flash_attention_2" if HAS_FLASH else "sdpa")


@pytest.mark.skipif(HAS_FLASH, reason="flash-attn is installed here, so forcing it is valid")
def test_forcing_flash_without_the_package_says_how_to_fix():
    with pytest.raises(ValueError, match="needs the flash-attn package.*drop that flag / pass --attn_implementation sdpa"):
        attention_implementation("flash_attention_2")


def test_unknown_name_lists_valid():
    with pytest.raises(ValueError, match="unknown attention implementation 'flash'; valid: flash_attention_2, sdpa, eager"):
        attention_implementation("flash")


def test_tiny_model_loads_with_the_choice(tmp_path):
    from transformers import AutoModelForCausalLM

    from rl_rollout.testing import make_tiny_model

    path = make_tiny_model(tmp_path / "tiny")
    impl = attention_implementation()
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=impl)
    assert model.config._attn_implementation == impl
    eager = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
    ids = torch.randint(5, 100, (2, 12))
    torch.testing.assert_close(model(ids).logits, eager(ids).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(HAS_FLASH, reason="flash-attn is installed here: it is the default for packed rows too")
def test_packed_rows_default_to_torch_varlen_where_it_runs(monkeypatch):
    """The default for a model that sees packed rows: torch_varlen on CUDA in bf16/fp16 with full attention (3.6x
    sdpa's masked path on the H200), sdpa otherwise. Whether the kernel can run is the one thing faked here (no GPU
    on this machine); the kernel itself is tested on the H200 (test_core_varlen_attention.py)."""
    from types import SimpleNamespace

    import rl_core.varlen_attention as va

    full, windowed = SimpleNamespace(sliding_window=None), SimpleNamespace(sliding_window=4096, use_sliding_window=True)
    off = SimpleNamespace(sliding_window=4096, use_sliding_window=False)  # Qwen2's config: a window, switched off
    here = attention_implementation(packed=True, dtype="bf16", model_config=full)
    assert here == ("torch_varlen" if va.varlen_available() is None else "sdpa")
    monkeypatch.setattr(va, "varlen_available", lambda: None)  # as on a GPU with torch >= 2.10
    assert attention_implementation(packed=True, dtype="bf16", model_config=full) == "torch_varlen"
    assert attention_implementation(packed=True, dtype="fp16", model_config=off) == "torch_varlen"
    assert attention_implementation(packed=True, dtype="fp32", model_config=full) == "sdpa"  # the kernel: bf16/fp16
    assert attention_implementation(packed=True, dtype="bf16", model_config=windowed) == "sdpa"
    assert attention_implementation(packed=False, dtype="bf16", model_config=full) == "sdpa"  # padded rows: as before
    assert attention_implementation("sdpa", packed=True, dtype="bf16", model_config=full) == "sdpa"  # asked for
