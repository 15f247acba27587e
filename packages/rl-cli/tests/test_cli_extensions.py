"""Extension is one file: a module outside the packages registers an advantage estimator and a policy-loss
variant, each with a parameter of its own, and ``rl ppo`` runs them from flags and from YAML with no edit to the
packages (``--extension``, ``--estimator_args``, ``--policy_loss_args``), in one process and over Ray; help and
errors list the registries' names, the extension's included."""

from __future__ import annotations

import json
import sys

import pytest
import yaml

from rl_cli.main import main

pytestmark = [pytest.mark.timeout(900)]

EXTENSION = '''
"""An extension: a tempered GRPO estimator and a scaled PPO loss, registered with rl-algos' registries."""
import dataclasses
import json
import os
from dataclasses import dataclass
from typing import ClassVar

from rl_algos import ESTIMATORS, POLICY_LOSSES, PPOLossConfig
from rl_algos.advantages import group_norm

LOG = os.environ["RL_TEST_EXTENSION_LOG"]


def tempered(scores_B, mask_BT, *, n_samples, temperature=1.0, **loop):
    with open(LOG, "a") as f:
        f.write(json.dumps({"estimator": temperature, "loop": sorted(loop)}) + "\\n")
    return group_norm(scores_B / temperature, mask_BT, n_samples=n_samples, **loop)


ESTIMATORS.register("tempered_grpo", tempered, min_group_size=2, params={"temperature": float})


@dataclass(frozen=True)
class ScaledPPOLoss(PPOLossConfig):
    type: ClassVar[str] = "scaled_ppo"
    scale: float = 1.0

    def loss(self, *args, **kwargs):
        out = super().loss(*args, **kwargs)
        with open(LOG, "a") as f:
            f.write(json.dumps({"loss_scale": self.scale}) + "\\n")
        return dataclasses.replace(out, loss=out.loss * self.scale)


POLICY_LOSSES.register(ScaledPPOLoss)
'''


@pytest.fixture
def ext(tmp_path, monkeypatch):
    """The extension file, its call log; the registries and sys.modules as they were afterwards."""
    from rl_algos import ESTIMATORS, POLICY_LOSSES

    path = tmp_path / "my_ext.py"
    path.write_text(EXTENSION)
    log = tmp_path / "calls.jsonl"
    monkeypatch.setenv("RL_TEST_EXTENSION_LOG", str(log))
    modules = set(sys.modules)
    yield path, log
    ESTIMATORS.pop("tempered_grpo", None)
    POLICY_LOSSES.pop("scaled_ppo", None)
    for name in set(sys.modules) - modules:
        if name.startswith("rl_extension_"):
            del sys.modules[name]


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from rl_rollout.testing import make_tiny_model

    root = tmp_path_factory.mktemp("ext")
    model = make_tiny_model(root / "tiny")
    (root / "prompts.jsonl").write_text(
        "".join(json.dumps({"prompt": f"Repeat the letter {c}: ", "label": c}) + "\n" for c in "abcd"))
    (root / "reward.py").write_text("def letter(prompt, response, label, **info):\n"
                                    "    return min(response.count(label), 8) / 8\n")
    return root, model


def run_args(root, model, run):
    return ["--pretrain", str(model), "--prompt_data", str(root / "prompts.jsonl"), "--input_key", "prompt",
            "--label_key", "label", "--reward_fn", f"{root / 'reward.py'}:letter", "--n_samples_per_prompt", "4",
            "--rollout_batch_size", "2", "--train_batch_size", "8", "--micro_train_batch_size", "4",
            "--generate_max_len", "6", "--max_iterations", "1", "--bf16", "false", "--init_kl_coef", "0",
            "--rollout_engine", "hf", "--seed", "3", "--run_dir", str(root / run)]


EXT_FLAGS = ["--advantage_estimator", "tempered_grpo", "--estimator_args", "temperature=0.5",
             "--policy_loss_type", "scaled_ppo", "--policy_loss_args", "scale=2.0"]


def calls(log):
    return [json.loads(x) for x in log.read_text().splitlines()]


def test_flags_run_the_extensions_estimator_and_loss_with_their_parameters(ext, task, capsys):
    path, log = ext
    root, model = task
    assert main(["ppo", "--extension", str(path), *run_args(root, model, "flags"), *EXT_FLAGS]) == 0
    seen = calls(log)
    estimator = [c for c in seen if "estimator" in c]
    assert estimator and all(c["estimator"] == 0.5 for c in estimator)
    assert estimator[0]["loop"] == ["gamma", "token_rewards_BT"]  # only the loop inputs its entry declares
    losses = [c for c in seen if "loss_scale" in c]
    assert losses and all(c["loss_scale"] == 2.0 for c in losses)
    assert (root / "flags" / "metrics.jsonl").is_file()


def test_yaml_runs_the_same_extension(ext, task, tmp_path):
    path, log = ext
    root, model = task
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"cli": {"extension": [str(path)]}, "ppo": {
        "advantage_estimator": "tempered_grpo", "estimator_args": ["temperature=0.25"],
        "policy_loss_type": "scaled_ppo", "policy_loss_args": ["scale=3.0"]}}))
    assert main(["ppo", "--config", str(config), *run_args(root, model, "yaml")]) == 0
    seen = calls(log)
    assert {c["estimator"] for c in seen if "estimator" in c} == {0.25}
    assert {c["loss_scale"] for c in seen if "loss_scale" in c} == {3.0}


def test_help_lists_the_registries_with_the_extension_and_errors_name_its_parameters(ext, task, capsys):
    path, _ = ext
    root, model = task
    with pytest.raises(SystemExit):
        main(["ppo", "--extension", str(path), "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "registered: dr_grpo, gae, group_norm, reinforce, reinforce_baseline, rloo, tempered_grpo" in text
    assert "registered: gspo, ppo, scaled_ppo" in text
    with pytest.raises(SystemExit):
        main(["ppo", "--extension", str(path), *run_args(root, model, "bad"), "--advantage_estimator",
              "tempered_grpo", "--estimator_args", "temp=2", "--print_config"])
    assert "has no parameter 'temp'; its parameters: temperature (float)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["ppo", "--extension", str(path), *run_args(root, model, "bad"), "--policy_loss_type", "scaled_ppo",
              "--policy_loss_args", "scale=big", "--print_config"])
    assert "scale='big' is not a float" in capsys.readouterr().err


def test_without_the_extension_the_name_is_unknown_and_a_bad_extension_says_why(task, tmp_path, capsys):
    root, model = task
    with pytest.raises(SystemExit):
        main(["ppo", *run_args(root, model, "none"), "--advantage_estimator", "tempered_grpo", "--print_config"])
    assert "unknown advantage estimator 'tempered_grpo'; valid: dr_grpo, gae" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="2"):
        main(["ppo", "--extension", str(tmp_path / "missing.py"), *run_args(root, model, "none")])
    err = capsys.readouterr().err
    assert "--extension" in err and "missing.py: no such file" in err
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(SystemExit, match="2"):
        main(["ppo", "--extension", str(broken), *run_args(root, model, "none")])
    assert "failed to import: RuntimeError: boom" in capsys.readouterr().err


@pytest.mark.slow
def test_ppo_ray_role_actors_import_the_extension(ext, task):
    """rl ppo-ray: the policy's Ray actor builds the extension's loss variant (it imports the module first,
    rl_cli.extensions.ENV); the driver runs its estimator."""
    import os
    import subprocess

    path, log = ext
    root, model = task
    argv = ["--extension", str(path), *run_args(root, model, "ray"), *EXT_FLAGS, "--num_gpus", "2"]
    env = {**os.environ, "RL_TEST_EXTENSION_LOG": str(log)}
    out = subprocess.run([sys.executable, "-m", "rl_cli.train_ppo_ray", *argv], capture_output=True, text=True,
                         timeout=600, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    seen = calls(log)
    assert {c["estimator"] for c in seen if "estimator" in c} == {0.5}
    assert {c["loss_scale"] for c in seen if "loss_scale" in c} == {2.0}  # written by the policy's actor
