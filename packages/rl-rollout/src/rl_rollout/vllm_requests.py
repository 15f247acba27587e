"""Our rollout types to vLLM's and back, for :class:`rl_rollout.vllm_engine.VLLMEngine`: the dtype name, a
request's prompt (token ids, and a vision-language prompt's images with their placeholder tokens), its
sampling parameters, and vLLM's outputs as :class:`~rl_rollout.types.RolloutSample` s with their log-probs and
finish reasons. vLLM is imported inside the functions that need it (it is an optional extra)."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import torch

from rl_rollout.types import FinishReason, RolloutRequest, RolloutSample
from rl_rollout.vision import is_vision_config, placeholder_token_ids
from rl_rollout.weights import as_torch_dtype


def vllm_dtype(dtype: str | torch.dtype) -> str:
    """The dtype name vLLM takes: ``"fp32"``/``torch.float32`` -> ``"float32"``, ``"bf16"`` -> ``"bfloat16"``,
    ``"fp16"`` -> ``"float16"``; ``"auto"`` and vLLM's own names pass through."""
    if isinstance(dtype, str) and dtype in ("auto", "float", "half"):
        return dtype
    try:
        return str(as_torch_dtype(dtype)).removeprefix("torch.")
    except ValueError:
        raise ValueError(f"unknown dtype {dtype!r}: use auto, float32/fp32, bfloat16/bf16 or float16/fp16") from None


def _placeholder_ids(model) -> list[int] | None:
    """A vision-language model's image/video placeholder ids (:func:`rl_rollout.vision.placeholder_token_ids`), or
    None for a text model (read from the folder's config; a model vLLM resolves otherwise counts as text)."""
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(model))
    except (OSError, ValueError):
        return None
    return placeholder_token_ids(config) if is_vision_config(config) else None


def _vllm_prompt(request: RolloutRequest, placeholders: list[int] | None) -> dict:
    """vLLM's prompt for a request. With images: ``multi_modal_data`` as given, and each image's expanded placeholder
    collapsed back to one token. Our prompts hold each image's placeholder expanded to its token count (what the
    model's processor makes and the trainer's forward takes); vLLM expands the placeholders of a token prompt
    itself, and would find one image per expanded token. A run of placeholders is one image when there are as many
    runs as images (Qwen-VL wraps each image in its own start/end tokens); otherwise (LLaVA's images side by side)
    every image has the same count and a run of several is split by it. The samples keep the expanded ids."""
    ids = list(request.prompt_token_ids)
    images = (request.multi_modal_data or {}).get("image") or []
    if not images:
        return {"prompt_token_ids": ids}
    if placeholders is None:
        raise ValueError(
            f"request {request.request_id!r} carries {len(images)} image(s) but the engine's model is "
            "not a vision-language model (its config has no vision_config): drop the images or load a "
            "VLM"
        )
    marks = set(placeholders)
    runs = [(t, len(list(g))) for t, g in itertools.groupby(ids)]  # consecutive equal tokens
    lengths = [n for t, n in runs if t in marks]
    per = None  # tokens per image when runs hold several images; None: one run per image
    if len(lengths) != len(images):
        per, rest = divmod(sum(lengths), len(images))
        if not per or rest or any(n % per for n in lengths):
            raise ValueError(
                f"request {request.request_id!r}: {len(images)} image(s) but its placeholder runs have "
                f"{lengths} tokens, which do not split into one equal run per image: build the prompt "
                "with the model's processor (one expanded placeholder per image, in order)"
            )
    collapsed = []
    for t, n in runs:
        collapsed += [t] * ((n // per if per else 1) if t in marks else n)
    return {"prompt_token_ids": collapsed, "multi_modal_data": {"image": list(images)}}


def _to_vllm_params(p, banned: Sequence[int] = ()):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        n=1 if p.greedy else p.n,  # vLLM refuses n > 1 when greedy; _to_samples repeats the one answer
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=max(p.top_k, 0),
        max_tokens=p.max_new_tokens,
        stop_token_ids=list(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        seed=p.seed,
        logprobs=0 if p.logprobs else None,  # 0: only the sampled token's logprob
        detokenize=False,  # token in, token out
        output_kind=RequestOutputKind.FINAL_ONLY,
        # a VLM's placeholder tokens are never sampled (vLLM clamps a bias to -100: e^-100 of the mass)
        **({"logit_bias": {int(t): -100.0 for t in banned}} if banned else {}),
    )


def _to_samples(request: RolloutRequest, output, version: int, version_end: int) -> list[RolloutSample]:
    samples = []
    completions = sorted(output.outputs, key=lambda c: c.index)
    if request.params.greedy and len(completions) == 1:
        completions = [dataclasses.replace(completions[0], index=i) for i in range(request.params.n)]
    for c in completions:
        ids = list(c.token_ids)
        logprobs = [step[t].logprob for t, step in zip(ids, c.logprobs, strict=True)] if request.params.logprobs else []
        finish: FinishReason = c.finish_reason if c.finish_reason in ("stop", "length") else "abort"
        info = {"request_id": request.request_id, "sample_index": c.index}
        if getattr(output, "num_cached_tokens", None) is not None:  # prompt tokens served from the prefix cache
            info["prompt_cached_tokens"] = output.num_cached_tokens
        if finish == "abort":
            info["vllm_finish_reason"] = c.finish_reason
        if version_end != version:
            info["policy_version_end"] = version_end
        samples.append(
            RolloutSample(
                prompt_ids=list(request.prompt_token_ids),
                response_ids=ids,
                rollout_logprobs=logprobs,
                loss_mask=[1] * len(ids),
                finish_reason=finish,
                policy_version=version,
                info=info,
            )
        )
    return samples
