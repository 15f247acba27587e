"""Data that crosses the rollout boundary: sampling parameters, requests, samples.

Only interfaces and data live here (no engine, no torch): a trainer that embeds
rl-rollout needs nothing else from this stack to talk to an engine. Token in,
token out: prompts are token ids and responses are token ids, never text.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

FinishReason = Literal["stop", "length", "abort"]
FINISH_REASONS: tuple[FinishReason, ...] = ("stop", "length", "abort")


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request's responses.

    ``temperature == 0`` means greedy. ``top_k == 0`` (or -1) and ``top_p == 1``
    disable those filters. ``stop_token_ids`` end a response in addition to the
    model's EOS (unless ``ignore_eos``); the stop token is kept in the response.
    With ``logprobs`` the engine returns, per response token, the log
    probability of the sampled token under the distribution it was sampled
    from: ``log_softmax(filter(logits / temperature))`` where ``filter`` is
    top-k/top-p (identity by default), and ``log_softmax(logits)`` when greedy.
    ``seed`` makes a request's sampling reproducible on one engine.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 128
    n: int = 1
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    logprobs: bool = True
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 disables it), got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be 0 or -1 (disabled) or >= 1, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.n < 1:
            raise ValueError(f"n (samples per prompt) must be >= 1, got {self.n}")
        # Accept any iterable of ints but store a tuple so the dataclass stays hashable.
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class RolloutRequest:
    """One prompt (token ids) to sample ``params.n`` responses for.

    ``multi_modal_data``: a vision-language model's images, ``{"image": [PIL images]}`` in prompt order (vLLM's
    form); ``prompt_token_ids`` then hold each image's placeholder expanded to its token count, as the model's
    processor writes them (:mod:`rl_rollout.vision`).
    """

    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    metadata: dict[str, Any] = field(default_factory=dict)
    multi_modal_data: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if len(self.prompt_token_ids) == 0:
            raise ValueError(f"request {self.request_id!r}: prompt_token_ids is empty; pass at least one token id")


@dataclass
class RolloutSample:
    """One generated response with everything the trainer needs from the rollout.

    ``rollout_logprobs`` and ``loss_mask`` have one entry per ``response_ids``
    token (``loss_mask`` is 0 on tokens the policy did not generate, e.g.
    environment turns appended by an agent). ``rollout_logprobs`` is empty when
    the request asked for ``logprobs=False``. ``policy_version`` is the weight
    version that generated the sample (see ``RolloutEngine.update_weights``).
    ``multi_modal_data``: the images the sample's ids hold placeholders of
    (``{"image": [PIL images]}`` in order), set by an agent episode whose
    observations carried images (its prompt's images first); None otherwise (a
    single turn's images are its request's).
    """

    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: list[float]
    loss_mask: list[int]
    finish_reason: FinishReason
    policy_version: int
    reward: float | None = None
    info: dict[str, Any] = field(default_factory=dict)
    multi_modal_data: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"finish_reason must be one of {FINISH_REASONS}, got {self.finish_reason!r}")
        n = len(self.response_ids)
        if self.rollout_logprobs and len(self.rollout_logprobs) != n:
            raise ValueError(f"rollout_logprobs has {len(self.rollout_logprobs)} entries for {n} response tokens")
        if len(self.loss_mask) != n:
            raise ValueError(f"loss_mask has {len(self.loss_mask)} entries for {n} response tokens")
