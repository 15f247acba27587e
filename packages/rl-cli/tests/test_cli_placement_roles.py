"""``rl ppo-ray``: the placement flags of a role the run does not have are refused before anything loads, naming
the flags and why the run has no such role (a flag is used or refused, never accepted and ignored)."""

from __future__ import annotations

import pytest

from rl_cli.main import main

BASE = ["ppo-ray", "--pretrain", "/nonexistent/model", "--prompt_data", "/nonexistent/prompts.jsonl",
        "--reward_fn", "builtin:math"]


@pytest.mark.parametrize("extra, message", [
    (["--advantage_estimator", "group_norm", "--n_samples_per_prompt", "4", "--critic_num_gpus_per_node", "2"],
     "--critic_num_gpus_per_node place the critic, and this run has none (--advantage_estimator group_norm needs no "
     "value model; gae does): drop --critic_num_gpus_per_node"),
    (["--init_kl_coef", "0", "--ref_num_nodes", "1", "--ref_num_gpus_per_node", "1"],
     "--ref_num_nodes and --ref_num_gpus_per_node place the reference model, and this run has none"),
    (["--reward_num_gpus_per_node", "1"], "--reward_num_gpus_per_node place the reward model, and this run has none "
                                          "(no --reward_pretrain)"),
])
def test_placement_flags_of_a_missing_role_are_refused(extra, message, capsys):
    with pytest.raises(SystemExit) as e:
        main([*BASE, *extra])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_placement_flags_of_a_present_role_pass_the_check():
    from rl_cli.config import build_parser
    from rl_cli.loading import resolve
    from rl_cli.placement_args import check_role_placement
    from rl_cli.ppo import _groups

    groups = _groups(True)
    parser, flags = build_parser("rl ppo-ray", "", groups)
    c = resolve(groups, parser.parse_args(["--pretrain", "/m", "--advantage_estimator", "gae", "--init_kl_coef", "0.01",
                                           "--critic_num_gpus_per_node", "2", "--ref_num_gpus_per_node", "1"]), flags)
    check_role_placement(c["ray"], c["ppo"], c["model"])  # a critic (gae) and a reference (KL): nothing refused
