"""``HFEngine``: the RolloutEngine over transformers ``generate``, for CPUs and single-controller runs.

Prompts of a batch are left-padded; each prompt is repeated ``n`` times.
Requests are grouped by identical :class:`~rl_rollout.types.SamplingParams`
(one ``generate`` call takes one configuration). Rollout logprobs are exact
for the distribution sampled from: ``log_softmax`` of the processed scores
transformers samples with (logits / temperature, then top-k / top-p masking);
greedy requests report ``log_softmax(logits)``. Weights change in place
(``update_weights``, or ``init_weight_group`` + ``receive_weights`` from a
trainer's :class:`~rl_rollout.transport.CollectiveSender`, verified after the
load where the model's dtype is the wire dtype). ``sleep`` moves the model to the
host when it lives on an accelerator (on CUDA, returning the freed memory to the
driver, where a colocated trainer can allocate it) and is a no-op on CPU. ``agenerate`` runs one request at a
time; with ``batch_agenerate = True`` the calls made in the same event-loop tick (an agent executor's episodes,
each at its next turn) run as one batch, and requests that differ only in ``seed`` share one ``generate`` call
seeded from all their seeds (reproducible for the same set of requests, no longer per request). Not here:
continuous batching (a request waits for the batch in flight), stop strings, prefix caching.

Vision-language models (a config with ``vision_config``: ``AutoModelForImageTextToText``): a request's
``multi_modal_data["image"]`` goes through the model's image processor (loaded from the model folder, or
``processor=``) and ``generate`` gets the image tensors of the batch's rows, each prompt's repeated ``n`` times;
the image placeholder tokens are never sampled (:func:`rl_rollout.vision.placeholder_token_ids`).

Partial rollouts (``partial_chunk_tokens = K``, the RL loop's ``--partial_rollout``): ``generate`` samples K
tokens at a time and releases the engine's lock between chunks, so a weight update arriving mid-response
lands between two chunks and the rest of the response is sampled with the new weights (the prefix is re-read
by them: no KV cache survives, so nothing old is reused); each token's weight version is in
``info["token_versions"]`` and ``policy_version`` is the oldest. Each chunk is seeded ``seed + chunk index``.

Here: building the engine, generation, sleep and wake; the weight paths and their checks are
:mod:`rl_rollout.hf_weights` (a mixin of :class:`HFEngine`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import threading
from typing import TYPE_CHECKING, cast

import torch

from rl_rollout.hf_weights import HFWeightsMixin
from rl_rollout.partial import generate_in_chunks
from rl_rollout.tick_batch import TickBatcher
from rl_rollout.transport import CollectiveReceiver
from rl_rollout.types import FinishReason, RolloutRequest, RolloutSample, SamplingParams
from rl_rollout.vision import cat_image_inputs, causal_lm_class, image_inputs, placeholder_token_ids, token_types

if TYPE_CHECKING:
    from transformers import GenerationMixin, PreTrainedModel

    class _CausalLM(PreTrainedModel, GenerationMixin):
        """What the engine holds: a transformers model that generates (as AutoModelForCausalLM's classes are)."""


class HFEngine(HFWeightsMixin):
    """Generation with a transformers causal LM.

    ``model``: a folder (``from_pretrained``) or an already built
    ``PreTrainedModel`` (shared with a trainer, say; then ``update_weights``
    is unnecessary). ``max_batch_sequences`` bounds the sequences (prompts x n)
    of one ``generate`` call.
    """

    def __init__(
        self,
        model: str | os.PathLike | torch.nn.Module,
        *,
        dtype: str | torch.dtype = "float32",
        device: str | torch.device = "cpu",
        max_batch_sequences: int = 64,
        attn_implementation: str = "sdpa",
        processor=None,
    ) -> None:
        if max_batch_sequences < 1:
            raise ValueError(f"max_batch_sequences must be >= 1, got {max_batch_sequences}")
        self._processor = processor  # a VLM's (image) processor; loaded from the folder on the first image
        self._model_path = None if isinstance(model, torch.nn.Module) else str(model)
        self._model: _CausalLM | None
        if isinstance(model, torch.nn.Module):
            self._model = cast("_CausalLM", model)  # an already built transformers model (the class docstring)
        else:
            torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
            self._model = (
                causal_lm_class(model)
                .from_pretrained(str(model), dtype=torch_dtype, attn_implementation=attn_implementation)
                .to(device)
            )
        self.model.eval()
        self.device = (
            torch.device(device) if not isinstance(model, torch.nn.Module) else next(model.parameters()).device
        )
        cfg = self.model.config.get_text_config()  # a VLM's token ids live in its text config
        gen_cfg = getattr(self.model, "generation_config", None)
        self.eos_token_ids = _as_id_list(getattr(gen_cfg, "eos_token_id", None) or cfg.eos_token_id)
        pad = getattr(gen_cfg, "pad_token_id", None)
        self.pad_token_id = pad if pad is not None else (cfg.pad_token_id if cfg.pad_token_id is not None else 0)
        self.max_batch_sequences = max_batch_sequences
        self._placeholders = placeholder_token_ids(self.model.config)  # a VLM's image tokens: never sampled
        self.policy_version = 0
        self._sleeping = False
        self._lock = threading.Lock()
        self._ticks = TickBatcher(lambda reqs: asyncio.to_thread(self.generate_batch, reqs))  # batch_agenerate
        self.batch_agenerate = False  # the RL loop's agent episodes turn it on (module docstring)
        self.partial_chunk_tokens: int | None = None  # partial rollouts (``_generate_partial``); None: off
        self._updates_waiting = 0  # update_weights calls waiting for the lock (a partial rollout lets them in)
        self._receiver: CollectiveReceiver | None = None  # set by init_weight_group

    @property
    def model(self) -> _CausalLM:
        """The transformers model that generates (the one passed in, or loaded from the folder)."""
        if self._model is None:
            raise RuntimeError("HFEngine was shut down; build a new engine")
        return self._model

    # ---- generation ----

    def generate(self, requests: list[RolloutRequest]) -> list[list[RolloutSample]]:
        chunk_tokens = self.partial_chunk_tokens
        partial = chunk_tokens is not None
        with contextlib.nullcontext() if partial else self._lock:  # partial: locked chunk by chunk
            if not partial:
                self._check_awake()
            results: dict[int, list[RolloutSample]] = {}
            groups: dict[SamplingParams, list[int]] = {}
            for i, req in enumerate(requests):
                groups.setdefault(req.params, []).append(i)
            for params, idx in groups.items():
                per_call = max(1, self.max_batch_sequences // params.n)
                for start in range(0, len(idx), per_call):
                    chunk = idx[start : start + per_call]
                    reqs = [requests[i] for i in chunk]
                    samples = (
                        self._generate_partial(reqs, params, chunk_tokens)
                        if chunk_tokens is not None
                        else self._generate_group(reqs, params)
                    )
                    results.update(zip(chunk, samples, strict=True))
            return [results[i] for i in range(len(requests))]

    def _generate_partial(
        self, requests: list[RolloutRequest], params: SamplingParams, chunk_tokens: int
    ) -> list[list[RolloutSample]]:
        """Partial rollouts (:func:`rl_rollout.partial.generate_in_chunks`): ``chunk_tokens`` new tokens at a
        time, the lock released in between, so a weight update lands mid-response and the rest is sampled (its
        prefix re-read) with the new weights. One seed per chunk for the whole batch (one generator stream)."""

        def chunk(reqs: list[RolloutRequest], p: SamplingParams):
            with self._lock:
                self._check_awake()
                return self._generate_group(reqs, p), self.policy_version

        return generate_in_chunks(requests, params, chunk_tokens, chunk, lambda: self._updates_waiting)

    async def agenerate(self, request: RolloutRequest) -> list[RolloutSample]:
        if not self.batch_agenerate:
            (samples,) = await asyncio.to_thread(self.generate, [request])
            return samples
        return await self._ticks.submit(request)

    def generate_batch(self, requests: list[RolloutRequest]) -> list[list[RolloutSample]]:
        """One turn of several episodes as one batch: requests that differ only in ``seed`` share one ``generate``
        call seeded from all their seeds (what ``batch_agenerate`` runs; an engine actor's ``generate_turns``)."""
        seeds = [r.params.seed for r in requests]
        if len(requests) > 1 and all(x is not None for x in seeds):  # one generate call needs one seed
            seed = hash(tuple(seeds)) & 0x7FFFFFFF
            requests = [dataclasses.replace(r, params=dataclasses.replace(r.params, seed=seed)) for r in requests]
        return self.generate(requests)

    @torch.no_grad()
    def _generate_group(self, requests: list[RolloutRequest], params: SamplingParams) -> list[list[RolloutSample]]:
        from transformers import GenerationConfig

        n = params.n
        prompts = [r.prompt_token_ids for r in requests for _ in range(n)]
        width = max(len(p) for p in prompts)
        input_ids_BT = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        attention_mask_BT = torch.zeros_like(input_ids_BT)
        for b, p in enumerate(prompts):  # left padding: the last prompt token sits at column width-1
            input_ids_BT[b, width - len(p) :] = torch.tensor(p)
            attention_mask_BT[b, width - len(p) :] = 1
        stop_ids = list(params.stop_token_ids) + ([] if params.ignore_eos else self.eos_token_ids)
        sampling = dict(do_sample=True, temperature=params.temperature, top_p=params.top_p, top_k=max(params.top_k, 0))
        # transformers' defaults (top_k=50, temperature from the checkpoint) must not leak in: all set here.
        gen_cfg = GenerationConfig(
            max_new_tokens=params.max_new_tokens,
            min_new_tokens=0,
            # None would let transformers fall back to the checkpoint's EOS (ignore_eos would not ignore it);
            # vocab_size is one past the last logit: a stop id that is never sampled
            eos_token_id=stop_ids or [self.model.config.get_text_config().vocab_size],
            pad_token_id=self.pad_token_id,
            output_scores=params.logprobs,
            suppress_tokens=self._placeholders or None,
            return_dict_in_generate=True,
            **(dict(do_sample=False) if params.greedy else sampling),
        )
        images = self._image_inputs(requests, n)
        images = {
            k: v.to(self.device) for k, v in {**images, **token_types(self.model.config, input_ids_BT, images)}.items()
        }
        seed_ctx = torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else [])
        with seed_ctx if params.seed is not None else contextlib.nullcontext():
            if params.seed is not None:
                torch.manual_seed(params.seed)
            # transformers types generate's self as a Protocol written for the ty checker (GenerativePreTrainedModel,
            # with attributes such as `encoder` that PreTrainedModel does not declare): mypy refuses any model
            out = self.model.generate(  # type: ignore[misc]
                input_ids=input_ids_BT.to(self.device),
                attention_mask=attention_mask_BT.to(self.device),
                generation_config=gen_cfg,
                **images,
            )
        if isinstance(out, torch.Tensor):  # return_dict_in_generate=True: an output object, never bare ids
            raise RuntimeError(
                f"transformers' generate returned a bare {type(out).__name__}, not an output object, "
                "despite return_dict_in_generate=True"
            )
        gen_BL = out.sequences[:, width:].cpu()
        if params.logprobs:
            if out.scores is None:
                raise RuntimeError("transformers' generate returned no scores despite output_scores=True")
            # step by step: stacking the steps' [B, V] scores would copy them all into one [B, L, V] (and its
            # log-softmax another): 18.5 GiB at 128 samples x 256 tokens x Qwen2.5's 151,936, out of memory on an H100
            gen_dev = gen_BL.to(out.scores[0].device)
            logprobs_BL = torch.stack(
                [
                    torch.log_softmax(s_BV.float(), dim=-1).gather(-1, gen_dev[:, t : t + 1]).squeeze(-1)
                    for t, s_BV in enumerate(out.scores)
                ],
                dim=1,
            ).cpu()
        stop_set = set(stop_ids)
        samples: list[list[RolloutSample]] = [[] for _ in requests]
        for b in range(len(prompts)):
            tokens = gen_BL[b].tolist()
            end = next((t + 1 for t, tok in enumerate(tokens) if tok in stop_set), None)
            finish: FinishReason = "stop" if end is not None else "length"
            tokens = tokens[: end or len(tokens)]
            samples[b // n].append(
                RolloutSample(
                    prompt_ids=list(prompts[b]),
                    response_ids=tokens,
                    rollout_logprobs=logprobs_BL[b, : len(tokens)].tolist() if params.logprobs else [],
                    loss_mask=[1] * len(tokens),
                    finish_reason=finish,
                    policy_version=self.policy_version,
                    info={"request_id": requests[b // n].request_id, "sample_index": b % n},
                )
            )
        return samples

    def _image_inputs(self, requests: list[RolloutRequest], n: int) -> dict:
        """The image tensors of the batch's rows (each request's images ``n`` times, in row order); ``{}``
        without images."""
        if not any(r.multi_modal_data for r in requests):
            return {}
        if self._processor is None:
            if self._model_path is None:
                raise ValueError("HFEngine got images but has no processor: pass processor= with a model object")
            from transformers import AutoProcessor

            self._processor = AutoProcessor.from_pretrained(self._model_path)
        proc = getattr(self._processor, "image_processor", self._processor)
        per_request = [image_inputs(proc, (r.multi_modal_data or {}).get("image") or []) for r in requests]
        return cat_image_inputs([p for p in per_request for _ in range(n)])

    def sleep(self, level: int = 1) -> None:
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        with self._lock:
            if self.device.type != "cpu":
                self.model.to("cpu")  # type: ignore[arg-type]  # transformers' functools.wraps on .to loses self
                if self.device.type == "cuda":  # hand the freed blocks back to the driver: the colocated
                    torch.cuda.empty_cache()  # trainer allocates in another process, not from our cache
            self._sleeping = True

    def wake_up(self, tags: list[str] | None = None) -> None:
        with self._lock:
            if self.device.type != "cpu":
                self.model.to(self.device)  # type: ignore[arg-type]  # transformers' functools.wraps on .to loses self
            self._sleeping = False

    def shutdown(self) -> None:
        self._model = None
        if getattr(self, "_ipc", None) is not None:
            self._ipc.close()  # releases the trainer's memory this engine had opened

    def _check_awake(self) -> None:
        if self._sleeping:
            raise RuntimeError("HFEngine is asleep: call wake_up() before generate()")
        if self._model is None:
            raise RuntimeError("HFEngine was shut down; build a new engine")


def _as_id_list(ids: int | list[int] | None) -> list[int]:
    if ids is None:
        return []
    return [ids] if isinstance(ids, int) else list(ids)
