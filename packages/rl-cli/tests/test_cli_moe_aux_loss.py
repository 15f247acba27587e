"""``rl sft`` with the MoE load-balancing loss, as OpenRLHF's train_sft_mixtral_lora.sh runs it: its own flags
(``--model.aux_loss_coef``, LoRA, packing, ZeRO-3, gradient checkpointing) on a tiny random Mixtral built here,
with the sizes and the CPU's dtype and attention in place of the script's; and a model without experts refused
in one line before it loads, by rl sft and rl ppo (rl-core's test_core_moe_aux_loss.py checks the loss itself)."""

from __future__ import annotations

import json

import pytest

from rl_cli.main import main

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from rl_rollout.testing import make_tiny_model

    root = tmp_path_factory.mktemp("sft-moe")
    make_tiny_model(root / "moe", hidden_size=32, num_heads=2, intermediate_size=64, num_experts=4)
    make_tiny_model(root / "llama", hidden_size=32, num_heads=2, intermediate_size=64)
    (root / "orca.jsonl").write_text("".join(json.dumps({"question": f"reverse {w}", "response": w[::-1]}) + "\n"
                                             for w in ("abc", "hello", "xyz", "moe")))
    return root


def test_the_mixtral_lora_script_trains_with_the_load_balancing_loss(files, capsys):
    out, run = files / "out", files / "run"
    assert main(["sft", "--data.max_len", "64", "--data.dataset", str(files / "orca.jsonl"), "--data.input_key",
                 "question", "--data.output_key", "response", "--train.batch_size", "4", "--train.micro_batch_size",
                 "2", "--model.model_name_or_path", str(files / "moe"), "--ckpt.output_dir", str(out),
                 "--ckpt.save_steps", "-1", "--logger.logging_steps", "1", "--eval.steps", "-1", "--ds.zero_stage",
                 "3", "--train.max_epochs", "1", "--model.gradient_checkpointing_enable", "--adam.lr", "5e-3",
                 "--ds.lora.rank", "4", "--ds.lora.alpha", "8", "--ds.packing_samples", "--model.aux_loss_coef",
                 "0.01", "--ds.experts_implementation", "batched_mm", "--bf16", "false", "--run_dir", str(run),
                 "--local_rank=0"]) == 0
    assert "[rl sft] done: 1 steps" in capsys.readouterr().out
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and all(1.0 <= r["train/aux_loss"] <= 4.0 for r in rows), rows  # E x balance: 1 at best
    saved = json.loads((out / "config.json").read_text())
    assert saved["model_type"] == "mixtral" and not saved.get("output_router_logits")  # the config as it was


def test_a_model_without_experts_is_refused_in_one_line_before_it_loads(files, capsys):
    with pytest.raises(SystemExit) as e:
        main(["sft", "--pretrain", str(files / "llama"), "--dataset", str(files / "orca.jsonl"), "--input_key",
              "question", "--output_key", "response", "--train_batch_size", "4", "--bf16", "false", "--aux_loss_coef",
              "0.01"])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "rl sft: --aux_loss_coef is the MoE load-balancing loss, but the model (llama) is not a mixture of experts "
        "(its config has no output_router_logits); drop --aux_loss_coef or give 0")


def test_rl_ppo_refuses_a_policy_without_experts_in_one_line_before_it_loads(files, capsys):
    with pytest.raises(SystemExit) as e:
        main(["ppo", "--pretrain", str(files / "llama"), "--prompt_data", str(files / "orca.jsonl"), "--input_key",
              "question", "--remote_rm_url", "http://127.0.0.1:9/score", "--bf16", "false", "--actor.aux_loss_coef",
              "0.01"])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "rl ppo: --aux_loss_coef is the MoE load-balancing loss, but the model (llama) is not a mixture of experts "
        "(its config has no output_router_logits); drop --aux_loss_coef or give 0")
