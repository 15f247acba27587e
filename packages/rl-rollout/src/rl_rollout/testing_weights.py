"""Test helpers about weights (:mod:`rl_rollout.testing` re-exports them): peaked random weights whose greedy
continuations tell two weight sets apart, greedy references from transformers, and the processes that share
a trainer's weights with an engine over CUDA IPC (here, not in a test file, so a spawned process can import
them)."""

from __future__ import annotations

from rl_rollout.ipc import IpcSender, share_buckets


def peaked_weights(model, *, seed: int = 0, embed_std: float = 0.3, residual_gain: float = 8.0) -> dict:
    """A new random state dict for ``model`` with varied, decisive next-token distributions.

    ``make_tiny_model``'s default init (std 0.02) gives nearly uniform logits,
    where greedy decoding hinges on rounding noise and two engines can disagree
    on ties. Large embeddings alone make a tied-embedding model copy its input
    token forever. Here embeddings (tied to the LM head) have std ``embed_std``,
    every matrix std ``1/sqrt(fan_in)``, and the residual writers (``o_proj``,
    ``down_proj``) are scaled by ``residual_gain``: on the tiny Llama that gives
    varied greedy text, mean entropy about 1.6 nats, and top-1/top-2 logit gaps
    of a few hundredths or more. Norm weights are 1. Returns ``{name: tensor}``
    (new tensors, the model's dtypes); the model is not modified.
    """
    import torch

    g = torch.Generator().manual_seed(seed)
    out = {}
    seen: dict[int, torch.Tensor] = {}  # tied weights (embed_tokens / lm_head) get one value
    for name, t in model.state_dict().items():
        if t.data_ptr() in seen:
            out[name] = seen[t.data_ptr()]
            continue
        if t.ndim == 1:
            new = torch.ones(t.shape)
        elif "embed_tokens" in name or "lm_head" in name:
            new = torch.randn(t.shape, generator=g) * embed_std
        else:
            new = torch.randn(t.shape, generator=g) / t.shape[1] ** 0.5
            if "o_proj" in name or "down_proj" in name:
                new = new * residual_gain
        out[name] = seen[t.data_ptr()] = new.to(t.dtype)
    return out


def greedy_reference(model, prompts: list[list[int]], n_tokens: int = 12, state: dict | None = None) -> list[list[int]]:
    """What an engine's greedy decoding of ``prompts`` must give: argmax continuations from full forward
    passes of the transformers ``model`` (after loading ``state`` when given), on the model's device,
    each stopping after EOS. The reference the engine tests compare token for token."""
    import torch

    if state is not None:
        model.load_state_dict(state)
    device = next(model.parameters()).device
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(n_tokens):
                ids.append(int(model(torch.tensor([ids], device=device)).logits[0, -1].argmax()))
                if ids[-1] == model.config.eos_token_id:
                    break
            out.append(ids[len(prompt) :])
    return out


def ipc_trainer_process(model_path: str, queue, done, corrupt: bool = False, seed: int = 1, pack: bool = True) -> None:
    """A child process standing in for a trainer on the GPU (tests and benchmarks of :mod:`rl_rollout.ipc`).

    Loads ``model_path`` on CUDA, sets :func:`peaked_weights` (``seed``), shares its state as
    checksummed CUDA IPC buckets through ``queue`` and keeps them alive until ``done`` is set.
    ``corrupt`` overwrites one byte of bucket 1 after sharing it (a trainer that changed memory
    it had shared); ``pack=False`` shares the parameters' own memory. Lives here, not in a test file, so a spawned process can import it.
    """
    import torch
    from transformers import AutoModelForCausalLM

    # transformers wraps Module.cuda with functools.wraps, whose typeshed type loses the bound self
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).cuda()  # type: ignore[call-arg]
    model.load_state_dict(peaked_weights(model, seed=seed), strict=False)
    buckets = list(share_buckets(model.state_dict().items(), bucket_bytes=1 << 20, checksum=True, pack=pack))
    if corrupt:
        buckets[1]._sender_payload()[0] ^= 1
        torch.cuda.synchronize()
    queue.put(buckets)
    done.wait(120)


def ipc_sender_process(model_path: str, to_engine, from_engine, seeds: list[int], pack: bool = True) -> None:
    """A trainer process for repeated syncs (:class:`rl_rollout.ipc.IpcSender`): for each seed, sets
    :func:`peaked_weights` in place, puts ``sender.share(...)`` on ``to_engine`` and waits for the
    engine's acknowledgement on ``from_engine`` (``"reset"`` there makes the next sync send fresh handles)."""
    import torch
    from transformers import AutoModelForCausalLM

    # transformers wraps Module.cuda with functools.wraps, whose typeshed type loses the bound self
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).cuda()  # type: ignore[call-arg]
    sender = IpcSender(bucket_bytes=1 << 20, checksum=True, pack=pack)
    for seed in seeds:
        with torch.no_grad():
            for name, t in peaked_weights(model, seed=seed).items():
                model.state_dict()[name].copy_(t)
        to_engine.put(sender.share(model.state_dict().items()))
        if from_engine.get(timeout=120) == "reset":
            sender.reset()
    to_engine.put(None)
