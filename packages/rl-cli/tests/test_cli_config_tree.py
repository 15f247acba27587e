"""The run's config tree through the command line: nodes as dotted flags and YAML mappings, optional nodes
turned on by their switch (their settings refused without it, naming the switch), and ``--print_config``'s YAML
read back by ``--config`` to the same run."""

from __future__ import annotations

import pytest
import yaml

from rl_algos import KLEstimator
from rl_cli.config import build_parser
from rl_cli.loading import resolve
from rl_cli.main import main
from rl_cli.ppo import _groups

BASE = ["--pretrain", "/nonexistent/m", "--prompt_data", "/nonexistent/p.jsonl", "--reward_fn", "builtin:math",
        "--label_key", "answer"]


def parse(argv, ray=False):
    groups = _groups(ray)
    parser, flags = build_parser("rl ppo", "", groups)
    return resolve(groups, parser.parse_args(argv), flags)


def printed(argv, capsys) -> tuple[dict, str]:
    capsys.readouterr()
    assert main(["ppo", *argv, "--print_config"]) == 0
    out = capsys.readouterr().out
    return yaml.safe_load(out), out


def test_flat_dotted_and_openrlhf_names_reach_the_same_node():
    for argv in (["--async_train", "--max_staleness", "2"], ["--ppo.async_rl", "--ppo.async_rl.max_staleness", "2"],
                 ["--train.async_enable", "--train.async_queue_size", "2"]):
        p = parse(BASE + argv)["ppo"]
        assert p.async_rl is not None and p.async_rl.max_staleness == 2, argv
    p = parse(BASE + ["--kl_estimator", "k3", "--ppo.kl.target", "0.1", "--algo.kl.init_coef", "0.2"])["ppo"]
    assert (p.kl.estimator, p.kl.target, p.kl.init_coef) == (KLEstimator.K3, 0.1, 0.2)
    p = parse(BASE)["ppo"]
    assert p.async_rl is None and p.ema is None and p.agent is None and p.ptx is None and p.dynamic_filtering is None


@pytest.mark.parametrize(("argv", "says"), [
    (["--max_staleness", "2"], "--max_staleness sets --async_train's settings: add --async_train"),
    (["--ema_beta", "0.9"], "--ema_beta sets --enable_ema's settings: add --enable_ema"),
    (["--max_staleness", "2", "--ppo.async_rl.partial_rollout"], "--max_staleness, --partial_rollout set"),
    (["--dynamic_filtering_max_rounds", "3"], "add --dynamic_filtering"),
    (["--agent_max_turns", "2"], "add --agent_func_path"),
    (["--ptx_coef", "0.1"], "add --pretrain_data"),
    (["--kl_estimator", "k4"], "argument --kl_estimator: 'k4' is not one of k1, k2, k3"),
])
def test_a_node_setting_without_its_node_stops_the_parse_naming_the_switch(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        main(["ppo", *BASE, *argv, "--print_config"])
    assert e.value.code == 2
    assert says in capsys.readouterr().err


def test_print_config_yaml_reads_back_to_the_same_run(tmp_path, capsys):
    argv = BASE + ["--advantage_estimator", "group_norm", "--n_samples_per_prompt", "4", "--train_batch_size", "32",
                   "--async_train", "--max_staleness", "2", "--generate_batch_size", "16", "--enable_ema",
                   "--ema_beta", "0.9", "--kl_estimator", "k3", "--use_kl_loss", "--critic_learning_rate", "2e-6",
                   "--save_steps", "5", "--ckpt_path", str(tmp_path / "ck"), "--eps_clip_high", "0.28",
                   "--dynamic_filtering", "--dynamic_filtering_reward_range", "0.1", "0.9"]
    first, out = printed(argv, capsys)
    assert first["ppo"]["async_rl"] == {"max_staleness": 2, "generate_batch_size": 16, "partial_rollout": False,
                                        "partial_rollout_mode": "auto", "partial_rollout_tokens": None}
    assert first["ppo"]["ema"] == {"beta": 0.9} and first["ppo"]["agent"] is None
    assert first["ppo"]["kl"]["estimator"] == "k3" and first["ppo"]["ckpt"]["save_steps"] == 5
    assert "# [rl ppo] per iteration: 8 prompts x 4 samples = 32 samples" in out  # the arithmetic, as comments
    saved = tmp_path / "run.yaml"
    saved.write_text(out)
    again, out_again = printed(["--config", str(saved)], capsys)
    # what the builder chose itself is marked as chosen; read back, the file sets it (the same value)
    chosen = [line for line in out.splitlines() if line.startswith("# [rl ppo] chosen (auto): ")]
    assert {c.split(": ")[1].split(" = ")[0] for c in chosen} == {
        "strategy.zero_stage", "data.packing", "model.use_liger_kernel", "model.fused_lm_head",
        "batching.max_tokens_per_gpu"}
    assert again == first and out_again.splitlines() == [line for line in out.splitlines() if line not in chosen]
    from rl_cli.ppo import _auto

    resolved = parse(argv)
    _auto(resolved, frozenset(), ray=False)
    assert parse(["--config", str(saved)]) == resolved  # the same config objects, node for node
    # a flag on the command line still wins over the file, into a node too
    assert printed(["--config", str(saved), "--max_staleness", "3"], capsys)[0]["ppo"]["async_rl"]["max_staleness"] == 3


def test_yaml_nodes_as_mappings_switches_and_null(tmp_path):
    y = tmp_path / "run.yaml"
    y.write_text("pretrain: /m\nppo:\n  async_rl: {max_staleness: 3}\n  ema: true\n  agent: null\n"
                 "  kl: {init_coef: 0.0}\n")
    p = parse(["--config", str(y), "--prompt_data", "p"])["ppo"]
    assert p.async_rl.max_staleness == 3 and p.ema is not None and p.ema.beta == 0.992 and p.agent is None
    assert not p.needs_reference
    y.write_text("ppo:\n  async_rl: null\n  max_staleness: 2\n")  # a flat key in the group: the layout of 0.14
    with pytest.raises(ValueError, match="--max_staleness sets --async_train's settings"):
        parse(["--config", str(y)])
    y.write_text("ppo:\n  async_train: true\n  max_staleness: 2\n  init_kl_coef: 0.0\n")
    p = parse(["--config", str(y)])["ppo"]
    assert p.async_rl.max_staleness == 2 and p.kl.init_coef == 0.0
    y.write_text("ppo:\n  async_rl: 3\n")
    with pytest.raises(ValueError, match="ppo.async_rl is a group of settings"):
        parse(["--config", str(y)])
