"""``AgentExecutor``: run multi-turn episodes of an engine against environments, token in / token out.

One trajectory alternates policy turns and environment observations in a
single token context ``prompt + response``:

- a policy turn is one ``engine.agenerate`` call (``n=1``) on the whole
  context; its sampled ids and rollout logprobs go into the response
  unchanged (loss mask 1). They are decoded only to hand the environment its
  action text; nothing is re-tokenized.
- an observation is ``tokenizer.encode(format_observation(text),
  add_special_tokens=False)`` (chat markup in the text becomes special
  tokens), appended with loss mask 0 and rollout logprob 0.0 (the policy did
  not sample it; the 0.0 is a placeholder a trainer must mask out).

A turn ends where the engine stops: EOS or ``params.stop_token_ids`` (e.g.
``<|im_end|>``), or ``params.max_new_tokens``; a turn cut by that per-turn cap
still goes to the environment. The episode ends, with ``finish_reason``:

- ``"stop"``: the environment said ``done`` (or failed, with
  ``env_error_reward`` set; ``info["env_error"]`` says how);
- ``"length"``: ``max_turns`` policy turns were taken without ``done``
  (``info["stop_cause"] == "max_turns"``), or ``max_len`` (prompt + response
  tokens) ran out (``"max_len"``): each turn's ``max_new_tokens`` is capped to
  the room left, and an observation that leaves no room for another policy
  token is dropped, not truncated;
- ``"abort"``: the engine aborted a turn; its tokens are kept, the
  environment is not stepped.

The observation returned with the last step is never appended: no policy
token follows it, so the response always ends on a policy token and a reward
placed on the last token lands on one the policy chose. Its text is in
``info["observations"]``. The reward is the sum of the step rewards
(``info["turn_rewards"]`` has each). ``policy_version`` is the oldest version
among the turns (weights may change mid-episode in asynchronous RL;
``info["turn_policy_versions"]`` has each). ``info["action_spans"]`` lists the
``[start, end)`` response positions of each policy turn. With partial rollouts (the
engine tags each token: ``info["token_versions"]`` of a turn's sample) the episode
has ``info["token_versions"]`` too: the version of every policy token, in response
order (the tokens of ``action_spans``; observation tokens were sampled by no policy).

Images (a vision-language policy, ``processor=``): the request's prompt images
(``AgentRequest.images``, placeholders already expanded in ``prompt_ids``) and
each observation's images (``StepResult.images``, or an ``Observation`` from
``reset``) are the episode's images, in order; an observation's image
placeholders are expanded as a prompt's (:mod:`rl_rollout.agents.images`) and
masked like the rest of it, every turn's request carries all images so far
(``multi_modal_data``), and so does the finished sample, for the trainer's
forward. Without a processor, an observation with images is refused.

Not here: batching turns of different trajectories into one engine call
(concurrent ``agenerate`` calls leave that to the engine), per-turn credit
assignment, tool-call parsing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rl_rollout.agents.env import Environment, Observation, StepResult
from rl_rollout.agents.images import ObservationImages
from rl_rollout.types import FinishReason, RolloutRequest, RolloutSample, SamplingParams
from rl_rollout.vision import load_images


@dataclass
class AgentRequest:
    """One task: prompt token ids, and what the environment's ``reset`` gets (prompt text, label, metadata).
    ``images``: a vision-language prompt's images (PIL images, paths ...), whose placeholders ``prompt_ids``
    already holds expanded (as a :class:`~rl_rollout.types.RolloutRequest`'s ``multi_modal_data``)."""

    prompt_ids: list[int]
    prompt: str | None = None
    label: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    images: list[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        if len(self.prompt_ids) == 0:
            raise ValueError(f"agent request {self.request_id!r}: prompt_ids is empty; pass at least one token id")


class EnvStepError(RuntimeError):
    """An environment's ``reset`` or ``step`` raised; the original exception is the ``__cause__``."""


class AgentExecutor:
    """Run ``params.n`` episodes per request, concurrently, and return one :class:`RolloutSample` each.

    ``engine``: anything with ``async agenerate(RolloutRequest)`` (a
    :class:`~rl_rollout.engine.RolloutEngine`, an ``EnginePool``).
    ``tokenizer``: a transformers tokenizer (``encode`` / ``decode``).
    ``env_factory()``: a fresh :class:`Environment` per episode.
    ``params``: sampling of every policy turn; ``n`` is episodes per request,
    ``max_new_tokens`` the per-turn cap, ``seed`` (if set) derives a distinct
    seed per (request, episode, turn). ``format_observation``: applied to each
    observation text before tokenizing (e.g. :class:`ChatTurnFormat`); None
    keeps it as is. ``env_error_reward``: None re-raises an exception from
    ``step`` as :class:`EnvStepError`; a number ends that episode with this
    step reward instead (``reset`` errors always raise: there is no episode).
    ``max_concurrency`` bounds episodes in flight (None: all at once).
    ``processor``: a vision-language policy's processor (``AutoProcessor``), which
    places observation images; None refuses them.
    """

    def __init__(
        self,
        engine: Any,
        tokenizer: Any,
        env_factory: Callable[[], Environment],
        *,
        max_turns: int,
        max_len: int,
        params: SamplingParams | None = None,
        format_observation: Callable[[str], str] | None = None,
        env_error_reward: float | None = None,
        max_concurrency: int | None = None,
        skip_special_tokens: bool = True,
        processor: Any = None,
    ) -> None:
        if not callable(getattr(engine, "agenerate", None)):
            raise TypeError(f"engine {type(engine).__name__} has no agenerate(request); pass a RolloutEngine")
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1 (policy turns per episode), got {max_turns}")
        if max_len < 2:
            raise ValueError(f"max_len must be >= 2 (prompt + response tokens), got {max_len}")
        if max_concurrency is not None and max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1 or None (no bound), got {max_concurrency}")
        self.engine = engine
        self.tokenizer = tokenizer
        self.env_factory = env_factory
        self.max_turns = max_turns
        self.max_len = max_len
        self.params = params if params is not None else SamplingParams()
        self.format_observation = format_observation
        self.env_error_reward = env_error_reward
        self.max_concurrency = max_concurrency
        self.skip_special_tokens = skip_special_tokens
        self.images = ObservationImages(processor)

    def run(self, requests: Sequence[AgentRequest | Sequence[int]]) -> list[list[RolloutSample]]:
        """Blocking :meth:`arun`; from inside a running event loop, await :meth:`arun` instead."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass  # no loop: the normal case
        else:
            raise RuntimeError("AgentExecutor.run was called in a running event loop; use `await executor.arun(...)`")
        return asyncio.run(self.arun(requests))

    async def arun(self, requests: Sequence[AgentRequest | Sequence[int]]) -> list[list[RolloutSample]]:
        """``params.n`` samples per request, in request order (a bare id list is a request without label)."""
        reqs = [r if isinstance(r, AgentRequest) else AgentRequest(prompt_ids=list(r)) for r in requests]
        for r in reqs:
            if len(r.prompt_ids) >= self.max_len:
                raise ValueError(
                    f"request {r.request_id!r}: prompt has {len(r.prompt_ids)} tokens, max_len is {self.max_len}; "
                    "raise max_len or filter long prompts"
                )
        gate = asyncio.Semaphore(self.max_concurrency) if self.max_concurrency else None

        async def bounded(i: int, k: int) -> RolloutSample:
            if gate is None:
                return await self._episode(reqs[i], i, k)
            async with gate:
                return await self._episode(reqs[i], i, k)

        n = self.params.n
        flat = await asyncio.gather(*(bounded(i, k) for i in range(len(reqs)) for k in range(n)))
        return [list(flat[i * n : (i + 1) * n]) for i in range(len(reqs))]

    # ---- one episode ----

    async def _episode(self, req: AgentRequest, req_index: int, sample_index: int) -> RolloutSample:
        env = self.env_factory()
        try:
            return await self._play(env, req, req_index, sample_index)
        finally:
            close = getattr(env, "close", None)
            if callable(close) and inspect.isawaitable(res := close()):
                await res

    async def _play(self, env: Environment, req: AgentRequest, req_index: int, sample_index: int) -> RolloutSample:
        name = type(env).__name__
        want_logprobs = self.params.logprobs
        context = list(req.prompt_ids)
        # the episode's images, in context order: the prompt's, then each observation's
        images = load_images(list(req.images)) if req.images else []
        response: list[int] = []
        logprobs: list[float] = []
        mask: list[int] = []
        spans: list[list[int]] = []
        rewards: list[float] = []
        versions: list[int] = []
        token_versions: list[int] = []  # one per policy token, when the engine tags them (partial rollouts)
        tagged = False
        observations: list[str] = []
        env_info: list[dict[str, Any]] = []
        extra: dict[str, Any] = {}

        def append(ids: list[int], lps: list[float] | None) -> None:
            context.extend(ids)
            response.extend(ids)
            mask.extend([0 if lps is None else 1] * len(ids))
            if want_logprobs:
                logprobs.extend([0.0] * len(ids) if lps is None else lps)

        try:
            first = await env.reset(req.prompt, req.label, **req.metadata)
        except Exception as e:
            raise EnvStepError(f"{name}.reset raised {type(e).__name__}: {e} (request {req.request_id!r})") from e
        if first is not None:
            text, refs = (first.text, first.images) if isinstance(first, Observation) else (first, [])
            ids, seen = self._encode(text, refs, f"{name}.reset")
            if len(context) + len(ids) >= self.max_len:
                raise ValueError(
                    f"{name}.reset returned an observation of {len(ids)} tokens; with the {len(req.prompt_ids)}-token "
                    f"prompt it leaves no room under max_len={self.max_len}: raise max_len or shorten it"
                )
            observations.append(text)
            append(ids, None)
            images += seen

        cause = "max_turns"
        for turn in range(1, self.max_turns + 1):
            params = dataclasses.replace(
                self.params,
                n=1,
                max_new_tokens=min(self.params.max_new_tokens, self.max_len - len(context)),
                seed=None if self.params.seed is None else _turn_seed(self.params.seed, req_index, sample_index, turn),
            )
            mm = {"image": list(images)} if images else None
            (sample,) = await self.engine.agenerate(RolloutRequest(list(context), params, multi_modal_data=mm))
            if want_logprobs and len(sample.rollout_logprobs) != len(sample.response_ids):
                raise ValueError(
                    f"{type(self.engine).__name__} returned {len(sample.rollout_logprobs)} logprobs for "
                    f"{len(sample.response_ids)} tokens although logprobs=True was asked"
                )
            start = len(response)
            append(list(sample.response_ids), list(sample.rollout_logprobs) if want_logprobs else [])
            spans.append([start, len(response)])
            versions.append(sample.policy_version)
            turn_tokens = sample.info.get("token_versions")
            tagged |= turn_tokens is not None
            token_versions += (
                turn_tokens if turn_tokens is not None else [sample.policy_version] * len(sample.response_ids)
            )
            if sample.finish_reason == "abort":
                cause = "abort"
                break
            if len(context) >= self.max_len:
                cause = "max_len"
                break
            action = self.tokenizer.decode(sample.response_ids, skip_special_tokens=self.skip_special_tokens)
            try:
                result = await env.step(action)
            except Exception as e:
                if self.env_error_reward is None:
                    raise EnvStepError(
                        f"{name}.step raised {type(e).__name__}: {e} at turn {turn} of request {req.request_id!r}; "
                        "fix the environment, or set env_error_reward to end such episodes with that reward"
                    ) from e
                extra["env_error"] = f"{type(e).__name__}: {e} (turn {turn})"
                rewards.append(float(self.env_error_reward))
                cause = "env_error"
                break
            if not isinstance(result, StepResult):
                raise TypeError(f"{name}.step returned {type(result).__name__} at turn {turn}; return a StepResult")
            rewards.append(float(result.reward))
            observations.append(result.observation)
            env_info.append(result.info)
            if result.done:
                cause = "done"
                break
            if turn == self.max_turns:
                break
            ids, seen = self._encode(result.observation, result.images, f"{name}.step at turn {turn}")
            if len(context) + len(ids) >= self.max_len:
                cause = "max_len"
                extra["dropped_observation_tokens"] = len(ids)
                break
            append(ids, None)
            images += seen

        if tagged:
            extra["token_versions"] = token_versions
        finishes: dict[str, FinishReason] = {"done": "stop", "env_error": "stop", "abort": "abort"}
        finish = finishes.get(cause, "length")
        return RolloutSample(
            prompt_ids=list(req.prompt_ids),
            response_ids=response,
            rollout_logprobs=logprobs,
            loss_mask=mask,
            finish_reason=finish,
            policy_version=min(versions),
            reward=sum(rewards),
            multi_modal_data={"image": images} if images else None,
            info={
                "request_id": req.request_id,
                "sample_index": sample_index,
                "turns": len(spans),
                "turn_rewards": rewards,
                "stop_cause": cause,
                "action_spans": spans,
                "observations": observations,
                "env_info": env_info,
                "turn_policy_versions": versions,
                **extra,
            },
        )

    def _encode(self, observation: str, refs: Sequence[Any], where: str) -> tuple[list[int], list]:
        """An observation's ids (formatted, its images' placeholders expanded) and its images, loaded."""
        return self.images.encode(self._encode_text, observation, refs, where)

    def _encode_text(self, observation: str) -> list[int]:
        text = self.format_observation(observation) if self.format_observation is not None else observation
        return list(self.tokenizer.encode(text, add_special_tokens=False))


def _turn_seed(seed: int, req_index: int, sample_index: int, turn: int) -> int:
    # Hashes of int tuples do not depend on PYTHONHASHSEED: reproducible across runs.
    return hash((seed, req_index, sample_index, turn)) & 0x7FFFFFFF
