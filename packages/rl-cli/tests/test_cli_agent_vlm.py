"""``rl ppo --image_key --agent_func_path``: a multi-turn VLM agent whose environment returns a screenshot each
turn (OpenRLHF 0.10+'s image observations), on a tiny random LLaVA with the HF engine: the trained samples hold
the prompt's image and every shown observation's, in order, their placeholders masked, and the trainer's
log-probs are the engine's (gap < 1e-5: the same pixels on both sides). That an observation's pixels move the
next turn's log-probs on both sides: rl-rollout's test_rollout_agent_images.py."""

from __future__ import annotations

import json

import pytest

from rl_cli.main import main
from rl_core.trainers.ppo_rollout import Sampler

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]

ENV = '''
from PIL import Image

from rl_rollout.agents import StepResult


class ScreenEnv:
    """Three turns; after each, a screenshot whose colour depends on the turn and the action."""

    def __init__(self):
        self.turn = 0

    async def reset(self, prompt, label, **info):
        self.label = label
        return None

    async def step(self, action_text):
        self.turn += 1
        shade = (70 * self.turn + 13 * len(action_text)) % 256
        screen = Image.new("RGB", (32, 24), (shade, 255 - shade, 90))
        hits = min(action_text.count(self.label), 4) / 4
        return StepResult(" screen: <image> go: ", reward=hits, done=self.turn >= 3, images=[screen])


def make_env():
    return ScreenEnv()
'''


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from rl_rollout.testing import make_tiny_vlm, write_test_images

    root = tmp_path_factory.mktemp("agent-vlm-cli")
    model = make_tiny_vlm(root / "tiny-vlm")
    imgs = write_test_images(root / "images", 2)
    rows = [{"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"Say {c}: "}]}],
             "images": [str(imgs[i])], "label": c} for i, c in enumerate("ab")]
    rows.append({"prompt": [{"role": "user", "content": "Say c: "}], "images": None, "label": "c"})  # no image
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "screen_env.py").write_text(ENV)
    return root, model


def argv(root, model, run, *extra):
    return ["ppo", "--pretrain", str(model), "--prompt_data", str(root / "prompts.jsonl"), "--input_key", "prompt",
            "--label_key", "label", "--image_key", "images", "--apply_chat_template",
            "--agent_func_path", str(root / "screen_env.py"), "--agent_max_turns", "3", "--agent_max_len", "96",
            "--advantage_estimator", "reinforce_baseline", "--n_samples_per_prompt", "2", "--rollout_batch_size", "3",
            "--train_batch_size", "6", "--micro_train_batch_size", "3", "--generate_max_len", "4",
            "--max_iterations", "2", "--bf16", "false", "--learning_rate", "1e-2", "--init_kl_coef", "0",
            "--seed", "3", "--rollout_engine", "hf", "--run_dir", str(root / run), *extra]


def test_rl_ppo_trains_a_vlm_agent_on_screenshots_from_its_environment(task, monkeypatch):
    root, model = task
    batches = []
    real = Sampler.sample_round

    def spy(self, k, seed):  # the real round; the test keeps its batch to read the items after training
        out = real(self, k, seed)
        batches.append(out[0])
        return out

    monkeypatch.setattr(Sampler, "sample_round", spy)
    assert main(argv(root, model, "run")) == 0
    rows = [json.loads(x) for x in (root / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:  # the trainer's forwards read the pixels the engine generated from
        assert r["rl/rollout_logprob_gap"] < 1e-5, r
    from transformers import AutoConfig

    ph = AutoConfig.from_pretrained(model).image_token_id
    assert len(batches) == 2
    for batch in batches:
        for prompt, s, item in zip([p for p in batch.prompts for _ in range(2)], batch.samples, batch.items,
                                   strict=True):
            shown = s.info["turns"] - 1  # every observation but the last step's is in the context
            assert s.info["turns"] == 3 and shown == 2
            own = 1 if prompt.get("images") else 0
            assert len(s.multi_modal_data["image"]) == own + shown
            assert item.image_inputs["pixel_values"].shape[0] == own + shown  # what the trainer's forward read
            at = [i for i, t in enumerate(item.input_ids_T) if t == ph]
            assert len(at) == 4 * (own + shown)  # 4 tokens per image
            assert all(item.loss_mask_T[i] == 0 for i in at)
            assert sum(i >= item.prompt_len for i in at) == 4 * shown  # the observations' (response) placeholders
            policy = {item.prompt_len + i for a, b in s.info["action_spans"] for i in range(a, b)}
            assert {i for i, x in enumerate(item.loss_mask_T) if x} == policy  # the policy's tokens, nothing else


def test_an_environment_image_for_a_text_only_model_stops_the_first_episode_naming_the_fix(task, tmp_path, capsys):
    from rl_rollout.testing import make_tiny_model

    root, _ = task
    text = make_tiny_model(tmp_path / "text")
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "Say a: ", "label": "a"}) + "\n")
    args = argv(root, text, "text")
    args[args.index("--prompt_data") + 1] = str(tmp_path / "p.jsonl")
    for flag, n in (("--image_key", 2), ("--apply_chat_template", 1)):
        i = args.index(flag)
        del args[i : i + n]
    args[args.index("--rollout_batch_size") + 1] = "1"
    args[args.index("--train_batch_size") + 1] = "2"
    args[args.index("--micro_train_batch_size") + 1] = "1"
    with pytest.raises(ValueError, match=r"ScreenEnv.step at turn 1 returned 1 image\(s\) but the policy takes no "
                                         r"images .*or return observations without images"):
        main(args)
