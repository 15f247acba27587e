"""Agent environments that return images (screenshots), on the real HFEngine with a tiny random LLaVA: each
observation image's placeholder expanded as a prompt's and masked, every turn generated from all images so far,
the sample carrying them in order (its log-probs those of one forward over those pixels, and the pixels of an
observation moving the next turn's log-probs); refusals for a text-only policy and for misplaced images; the
vLLM prompt of such a context (one placeholder per image)."""

from __future__ import annotations

import pytest
import torch

from rl_rollout import SamplingParams
from rl_rollout.agents import AgentExecutor, AgentRequest, Observation, StepResult
from rl_rollout.hf_engine import HFEngine
from rl_rollout.vision import image_inputs, load_images, placeholder_token_ids
from rl_rollout.vllm_requests import _vllm_prompt

TOKENS_PER_IMAGE = 4  # make_tiny_vlm: 28-pixel images in 14-pixel patches


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    from transformers import AutoProcessor

    from rl_rollout.testing import make_tiny_vlm, write_test_images

    root = tmp_path_factory.mktemp("agent-vlm")
    path = make_tiny_vlm(root / "model")
    return path, AutoProcessor.from_pretrained(path), HFEngine(path), load_images(write_test_images(root / "img", 4))


class ScreenEnv:
    """Shows a screenshot at reset (marked in the text) and one per step (unmarked: it goes before the text)."""

    def __init__(self, screens):
        self.screens, self.turn = screens, 0

    async def reset(self, prompt, label, **info):
        return Observation("screen: <image> act.", [self.screens[0]])

    async def step(self, action_text):
        self.turn += 1
        return StepResult(" next", reward=1.0, images=[self.screens[self.turn]])


def episode(vlm, screens, processor="vlm", seed=5):
    path, proc, engine, imgs = vlm
    prompt = proc.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "go"}]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    ids = [int(t) for t in proc(text=[prompt], images=[imgs[0]], add_special_tokens=False)["input_ids"][0]]
    ex = AgentExecutor(
        engine,
        proc.tokenizer,
        lambda: ScreenEnv(screens),
        max_turns=3,
        max_len=200,
        params=SamplingParams(n=1, max_new_tokens=4, seed=seed, ignore_eos=True),
        processor=proc if processor == "vlm" else processor,
    )
    [[s]] = ex.run([AgentRequest(ids, images=[imgs[0]])])
    return s


def forward_logprobs(vlm, sample, images):
    from transformers import AutoModelForImageTextToText

    path, proc, _, _ = vlm
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    seq = torch.tensor([sample.prompt_ids + sample.response_ids])
    with torch.no_grad():
        logits = model(input_ids=seq, **image_inputs(proc.image_processor, images)).logits[0]
    logits = logits[len(sample.prompt_ids) - 1 : -1]
    logits[:, placeholder_token_ids(model.config)] = float("-inf")  # never sampled (the engine suppresses them)
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(sample.response_ids)[:, None])[:, 0]


def test_observation_images_are_placed_masked_and_carried_to_every_turn_and_the_sample(vlm):
    _, proc, _, imgs = vlm
    screens = [imgs[1], imgs[2], imgs[3], imgs[0]]
    s = episode(vlm, screens)
    ph = proc.tokenizer.convert_tokens_to_ids("<image>")
    # prompt image + reset's + the observations after turns 1 and 2 (the last step's observation is never shown)
    assert s.multi_modal_data is not None and len(s.multi_modal_data["image"]) == 4
    assert [i.tobytes() for i in s.multi_modal_data["image"]] == [i.tobytes() for i in [imgs[0], *screens[:3]]]
    assert (s.prompt_ids + s.response_ids).count(ph) == 4 * TOKENS_PER_IMAGE
    at = [i for i, t in enumerate(s.response_ids) if t == ph]
    assert len(at) == 3 * TOKENS_PER_IMAGE and all(s.loss_mask[i] == 0 for i in at)
    # every policy token (mask 1) is the engine's, scored by one forward over all four images in order
    mask = torch.tensor(s.loss_mask, dtype=torch.bool)
    assert s.info["turns"] == 3 and int(mask.sum()) == 12
    lp = forward_logprobs(vlm, s, s.multi_modal_data["image"])
    assert torch.allclose(lp[mask], torch.tensor(s.rollout_logprobs)[mask], atol=1e-4)
    # the pixels of turn 1's observation move the policy's log-probs of turn 2 (and only from there on)
    other = [*s.multi_modal_data["image"][:2], imgs[0].transpose(0), s.multi_modal_data["image"][3]]
    moved = forward_logprobs(vlm, s, other)
    (a1, b1), (a2, b2) = s.info["action_spans"][:2]
    assert torch.allclose(moved[a1:b1], lp[a1:b1], atol=1e-6)
    assert (moved[a2:b2] - lp[a2:b2]).abs().max() > 1e-4
    # ... and the engine's: the same seeds, another screenshot after turn 1
    s2 = episode(vlm, [imgs[1], imgs[0].transpose(0), imgs[3], imgs[0]])
    assert s2.response_ids[a1:b1] == s.response_ids[a1:b1]
    assert s2.rollout_logprobs[a1:b1] == pytest.approx(s.rollout_logprobs[a1:b1], abs=1e-6)
    diff = [abs(x - y) for x, y in zip(s2.rollout_logprobs[a2:b2], s.rollout_logprobs[a2:b2], strict=True)]
    assert s2.response_ids[a2:b2] != s.response_ids[a2:b2] or max(diff) > 1e-4
    # vLLM takes the same context: each image's expanded placeholder collapsed back to one, the images in order
    from rl_rollout import RolloutRequest

    vllm = _vllm_prompt(RolloutRequest(s.prompt_ids + s.response_ids, multi_modal_data=s.multi_modal_data), [ph])
    assert vllm["prompt_token_ids"].count(ph) == 4 and len(vllm["multi_modal_data"]["image"]) == 4


def test_images_for_a_policy_that_cannot_take_them_are_refused_naming_the_fix(vlm):
    _, proc, _, imgs = vlm
    with pytest.raises(ValueError, match=r"ScreenEnv.reset returned 1 image\(s\) but the policy takes no images.*"
                                         r"or return observations without images"):
        episode(vlm, imgs, processor=None)
    with pytest.raises(ValueError, match=r"processor \(\w+\) has no image_token / image_processor"):
        episode(vlm, imgs, processor=proc.tokenizer)

    from rl_rollout.agents.images import ObservationImages

    with pytest.raises(ValueError, match=r"returned 1 image\(s\) but its text marks 2 image places \('<image>'\)"):
        ObservationImages(proc).encode(proc.tokenizer.encode, "<image><image>", [imgs[0]], "TwoMarks.reset")
    with pytest.raises(ValueError, match=r"image <int> does not load"):
        ObservationImages(proc).encode(proc.tokenizer.encode, "x", [3], "E.step")
