"""Hub ids resolve to snapshots of the local Hugging Face cache, offline; a missing one fails in one line."""

from __future__ import annotations

import dataclasses

import pytest

from rl_core.hub import ModelNotFoundError, hub_cache_dir, resolve_model, resolve_models
from rl_rollout.testing import cache_as_hub, make_tiny_model


@pytest.fixture
def hf_home(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "hf"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("m") / "tiny")


def test_a_cached_hub_id_resolves_to_its_snapshot_under_HF_HOME(hf_home, tiny):
    snap = cache_as_hub(tiny, "org/tiny", hf_home / "hub")
    got = resolve_model("org/tiny")
    assert got == str(snap)
    assert (snap / "config.json").is_file() and (snap / "config.json").is_symlink()


def test_HF_HUB_CACHE_wins_over_HF_HOME(hf_home, tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    snap = cache_as_hub(tiny, "org/tiny", tmp_path / "elsewhere")
    assert hub_cache_dir() == tmp_path / "elsewhere"
    assert resolve_model("org/tiny") == str(snap)


def test_a_local_folder_is_returned_as_given(hf_home, tiny):
    assert resolve_model(str(tiny)) == str(tiny)


def test_a_missing_id_fails_in_one_line_naming_the_id_the_flag_and_the_cache(hf_home):
    with pytest.raises(ModelNotFoundError) as e:
        resolve_model("Qwen/Qwen2.5-7B-Instruct", flag="--reward_pretrain")
    msg = str(e.value)
    assert "\n" not in msg
    assert "--reward_pretrain Qwen/Qwen2.5-7B-Instruct" in msg and str(hf_home / "hub") in msg


def test_a_missing_path_is_not_looked_up_as_an_id(hf_home, tmp_path):
    with pytest.raises(ModelNotFoundError, match="no such folder") as e:
        resolve_model(str(tmp_path / "nope"))
    assert "\n" not in str(e.value)


def test_resolve_models_replaces_every_set_model_field(hf_home, tiny):
    @dataclasses.dataclass(frozen=True)
    class Cfg:
        pretrain: str | None = None
        reward_pretrain: str | None = None
        ref_pretrain: str | None = None
        lr: float = 1.0

    snap = cache_as_hub(tiny, "org/tiny", hf_home / "hub")
    out = resolve_models(Cfg(pretrain="org/tiny", reward_pretrain=str(tiny)))
    assert out == Cfg(pretrain=str(snap), reward_pretrain=str(tiny))
