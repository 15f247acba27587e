"""rl_core.preflight's tokenizer loading: OpenRLHF's --disable_fast_tokenizer (use_fast=False) loads;
--tokenizer_chat_template replaces the chat template the rows are rendered with."""

from __future__ import annotations

import pytest

from rl_core.preflight import InputError, load_tokenizer


def test_use_fast_false_loads_a_tokenizer_that_encodes_the_same(tmp_path):
    from rl_rollout.testing import make_tokenizer

    make_tokenizer().save_pretrained(tmp_path)
    fast, slow = load_tokenizer(str(tmp_path)), load_tokenizer(str(tmp_path), use_fast=False)
    text = "Repeat the letter a:\n"
    assert slow("x")["input_ids"] and slow(text)["input_ids"] == fast(text)["input_ids"]
    assert slow.pad_token is not None


MARKED = "{% for m in messages %}[[{{ m['role'] }}]]{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}[[a]]{% endif %}"


def test_a_custom_chat_template_renders_the_prompts_and_is_saved(tmp_path):
    from rl_core.data import DataConfig, PromptDataset
    from rl_rollout.testing import make_tokenizer

    make_tokenizer().save_pretrained(tmp_path / "tok")
    cfg = DataConfig(apply_chat_template=True, tokenizer_chat_template=MARKED)
    rows = [{"input": "2+2?"}]
    own = PromptDataset(rows, load_tokenizer(str(tmp_path / "tok")), cfg)
    tok = load_tokenizer(str(tmp_path / "tok"), chat_template=cfg.tokenizer_chat_template)
    marked = PromptDataset(rows, tok, cfg)
    assert marked[0]["prompt"] == "[[user]]2+2?[[a]]" == tok.decode(marked[0]["prompt_ids"])
    assert marked[0]["prompt_ids"] != own[0]["prompt_ids"]
    tok.save_pretrained(tmp_path / "saved")  # what the trainers' export writes
    assert load_tokenizer(str(tmp_path / "saved")).chat_template == MARKED


def test_a_broken_chat_template_fails_in_one_line_naming_the_flag(tmp_path):
    from rl_rollout.testing import make_tokenizer

    make_tokenizer().save_pretrained(tmp_path)
    with pytest.raises(InputError, match=r"^--tokenizer_chat_template does not render a user message "
                                         r"\(TemplateSyntaxError: [^\n]+\); fix the Jinja") as e:
        load_tokenizer(str(tmp_path), chat_template="{% for m in messages %}{{ m.content }")
    assert "\n" not in str(e.value)


def test_a_chat_template_without_apply_chat_template_is_refused():
    from rl_core.data import DataConfig

    with pytest.raises(ValueError, match="only with --apply_chat_template"):
        DataConfig(tokenizer_chat_template=MARKED)
