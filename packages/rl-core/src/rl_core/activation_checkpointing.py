"""Gradient checkpointing by decoder layer: every layer, the first N, or as few as the device memory needs (``auto``).

transformers 5's decoder layers are ``GradientCheckpointingLayer``s: each reads its own ``gradient_checkpointing``
attribute at call time and, when it is true in training, runs through ``_gradient_checkpointing_func`` (torch's
non-reentrant checkpoint here): the layer keeps only its inputs and recomputes the rest in the backward.
``gradient_checkpointing_enable`` turns every layer on; :func:`select_checkpointed_layers` turns all but the first
N off again (``--gradient_checkpointing --gradient_checkpointing_layers N``). It acts on whatever module holds the
layers (an ``Actor``, ``Critic``, ``RewardModel``, a peft wrapper), so every trainer gets it through
``DeepSpeedStrategy.prepare``.

Why the first N and not every k-th: the backward visits layers last to first. With the first N recomputed, the
layers that keep their activations are the last ones, which the backward frees first; when it reaches a
recomputed layer only the inputs of the earlier ones are left, so a recompute never adds to the largest set of
held activations (Megatron-LM's ``recompute_method=block`` picks the same way). Spread evenly, the last recompute
runs while every earlier kept layer still holds its activations. For the same reason checkpointing the last layer
saves nothing: it recomputes at once.

Estimate (:class:`ActivationEstimate`), bytes per token of one micro-batch, ``e`` the weights' bytes per element,
``h`` hidden size, ``kv`` key/value width (KV heads x head dim), ``i`` the MLP's intermediate size:

- a layer that keeps its activations: ``8h + e(6h + 2kv + 4i)``: per RMSNorm its fp32 input and rsqrt (4h) and
  two ``e h`` tensors (normalised, scaled); q, k, v after RoPE and the attention output (sdpa / flash keep no
  T x T scores); gate, up, SiLU(gate) and the down projection's input. This is what autograd saves in a
  transformers Llama / Qwen2 layer, counted with ``saved_tensors_hooks`` (1.5% over at small shapes:
  cos / sin and the log-sum-exp; ``test_layer_estimate_matches_what_autograd_saves``); liger's fused kernels
  save less, so with them the estimate errs towards more recompute;
- a checkpointed layer: its input, ``e h``;
- the LM head (causal LMs only): ``V (e + 4)``, the logits and one fp32 copy (log-softmax or its gradient).

Held at the backward's peak with the first ``n`` of ``L`` layers checkpointed, ``T`` tokens:
``T (n e h + max(L - n, 1 if n else 0) x layer + head)``: every kept layer, every checkpointed input, and during a
recompute one layer's worth (the kept layers are freed by then).

``auto`` picks, before each training forward, the smallest ``n`` whose estimate fits the budget: free device
memory (``cudaMemGetInfo`` plus what torch's allocator holds unused) less what training will still allocate
(gradients of trainable parameters that have none yet, Adam moments of parameters the optimizer has no state
for) less 5% of the device for fragmentation and workspaces. ``T`` is that forward's ``input_ids.numel()`` (padded
rows, packed rows and token budgets alike), so long micro-batches recompute and short ones do not; the choice is
logged when it reaches a new high. Without a CUDA device there is no memory to read: every layer is checkpointed
and a warning says so. Leaves out: ZeRO-3's partitioned parameters in the pending-gradient sum (their numel is
0 on a rank) and any activation of a model other than a decoder stack (vision towers).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from rl_core.preflight import InputError

logger = logging.getLogger(__name__)

FLAG = "gradient_checkpointing_layers (--gradient_checkpointing_layers)"
MARGIN = 0.05  # of the device's memory, kept free for fragmentation, cuBLAS / NCCL workspaces


def parse_layers(value) -> str:
    """The flag's value as its canonical text: ``all``, ``auto`` or a whole number >= 0; else one clear error."""
    text = str(value).strip().lower()
    if text in ("all", "auto"):
        return text
    if text.isascii() and text.isdigit() and not isinstance(value, bool):
        return str(int(text))
    raise InputError(
        f"{FLAG} must be all, auto or a number of decoder layers >= 0 (the first N recompute), got {value!r}"
    )


def decoder_layers(module: nn.Module) -> list[nn.Module]:
    """The transformers ``GradientCheckpointingLayer``s under ``module``, in forward order."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in module.modules() if isinstance(m, GradientCheckpointingLayer)]


def layer_activation_bytes(hidden: int, kv_dim: int, intermediate: int, dtype_bytes: int) -> int:
    """Bytes per token that one transformers Llama/Qwen2 decoder layer leaves for its backward (module docstring)."""
    return 8 * hidden + dtype_bytes * (6 * hidden + 2 * kv_dim + 4 * intermediate)


@dataclass(frozen=True)
class ActivationEstimate:
    """Per-token byte counts of a decoder stack (module docstring); :meth:`bytes` is the backward's peak."""

    layers: int
    per_layer: int  # a layer that keeps its activations
    per_input: int  # a checkpointed layer: its input only
    head: int  # the LM head's logits and one fp32 copy; 0 without an LM head

    @classmethod
    def of(cls, module: nn.Module, layers: int) -> ActivationEstimate:
        from transformers import PreTrainedModel

        hf = next((m for m in module.modules() if isinstance(m, PreTrainedModel)), None)
        c = getattr(hf, "config", None)
        c = getattr(c, "text_config", None) or c
        if c is None or not all(hasattr(c, k) for k in ("hidden_size", "num_attention_heads", "intermediate_size")):
            raise InputError(
                f"{FLAG}=auto estimates activations from a decoder config (hidden_size, "
                f"num_attention_heads, intermediate_size); {type(module).__name__} has none: pass a "
                f"number of layers or all"
            )
        heads = c.num_attention_heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
        kv_dim = (getattr(c, "num_key_value_heads", None) or heads) * head_dim
        e = next(module.parameters()).element_size()
        lm_head = hf is not None and hf.get_output_embeddings() is not None  # (hf is: it has the config c)
        per_layer = layer_activation_bytes(c.hidden_size, kv_dim, c.intermediate_size, e)
        if any(type(m).__name__.startswith("Liger") for m in module.modules()):
            # liger's RMSNorm keeps its e-byte input, not an fp32 one (-8h), and its SwiGLU gate and up, not
            # SiLU(gate) (-e i): 1.58 MB per token at the 0.5B shape with the head below, against 1.54 MB
            # measured (docs/performance.md, SFT with liger: 31.5 GiB at 16,384 tokens, ~7.4 GiB of it states)
            per_layer -= 8 * c.hidden_size + e * c.intermediate_size
        return cls(
            layers=layers,
            per_layer=per_layer,
            per_input=e * c.hidden_size,
            head=c.vocab_size * (e + 4) if lm_head else 0,
        )

    def bytes(self, n: int, tokens: int) -> int:
        kept = self.layers - n
        return tokens * (n * self.per_input + max(kept, 1 if n else 0) * self.per_layer + self.head)

    def smallest_fit(self, tokens: int, budget: int) -> tuple[int, bool]:
        """``(n, fits)``: the fewest checkpointed layers whose estimate fits ``budget``; when none does, the ``n``
        with the smallest estimate and ``False``."""
        for n in range(self.layers + 1):
            if self.bytes(n, tokens) <= budget:
                return n, True
        return min(range(self.layers + 1), key=lambda n: self.bytes(n, tokens)), False


def set_checkpointed(layers: list[nn.Module], n: int) -> None:
    """Checkpoint ``layers[:n]``, keep activations in the rest (the checkpoint function was set by
    ``gradient_checkpointing_enable``)."""
    for k, layer in enumerate(layers):
        # the ignore: torch's stub types Module.__setattr__'s value as Tensor | Module; a plain flag is fine
        layer.gradient_checkpointing = k < n  # type: ignore[assignment]


def select_checkpointed_layers(module: nn.Module, spec: str, *, device: torch.device, optimizer=None) -> str:
    """Apply ``spec`` (:func:`parse_layers`) to a model whose layers ``gradient_checkpointing_enable`` turned on.

    ``auto`` on CUDA installs a forward pre-hook on ``module`` that chooses per training forward; ``optimizer``
    (a DeepSpeed or torch optimizer) tells which Adam moments are still to come. Returns what it did, in words.
    """
    spec = parse_layers(spec)
    if spec == "all":
        return "every decoder layer recomputes"
    layers = decoder_layers(module)
    if not layers:
        raise InputError(
            f"{FLAG}={spec} needs transformers decoder layers (GradientCheckpointingLayer) to choose "
            f"from; {type(module).__name__} has none: pass all"
        )
    if not all(hasattr(layer, "_gradient_checkpointing_func") for layer in layers):
        raise ValueError(
            f"{FLAG}={spec}: the layers of {type(module).__name__} have no checkpoint function yet; "
            f"call the transformers model's gradient_checkpointing_enable() first"
        )
    if spec != "auto":
        n = int(spec)
        if n > len(layers):
            raise InputError(
                f"{FLAG}={n} is more than the model's {len(layers)} decoder layers; pass 0..{len(layers)}, all or auto"
            )
        set_checkpointed(layers, n)
        return f"the first {n} of {len(layers)} decoder layers recompute"
    if device.type != "cuda":
        logger.warning(
            "%s=auto: no device memory to read on %s, so every decoder layer recomputes (as 'all')", FLAG, device.type
        )
        return f"every decoder layer recomputes (auto on {device.type}: no device memory to read)"
    hook = AutoCheckpointing(module, layers, ActivationEstimate.of(module, len(layers)), device, optimizer)
    module.register_forward_pre_hook(hook, with_kwargs=True)
    return f"auto: per training forward, the fewest of {len(layers)} decoder layers whose activations fit"


class AutoCheckpointing:
    """The forward pre-hook of ``auto`` (module docstring): sets the layers before each training forward."""

    def __init__(
        self,
        module: nn.Module,
        layers: list[nn.Module],
        estimate: ActivationEstimate,
        device: torch.device,
        optimizer=None,
    ):
        self.module, self.layers, self.estimate, self.device = module, layers, estimate, device
        self.optimizer = optimizer
        self.high = -1  # the most layers chosen so far (logged when exceeded)
        self.choices: list[tuple[int, int, int]] = []  # (tokens, budget, n) of the last forwards, for tests / debug

    def __call__(self, module, args, kwargs):
        if not (module.training and torch.is_grad_enabled()):
            return None
        ids = kwargs.get("input_ids", args[0] if args else None)
        if not isinstance(ids, torch.Tensor):
            return None
        tokens = ids.numel()
        budget = self.budget()
        n, fits = self.estimate.smallest_fit(tokens, budget)
        set_checkpointed(self.layers, n)
        self.choices = (self.choices + [(tokens, budget, n)])[-8:]
        if n > self.high or not fits:
            self.high = max(self.high, n)
            gib = 2**30
            (logger.info if fits else logger.warning)(
                "gradient checkpointing auto: %d of %d decoder layers recompute for %d tokens (estimate %.1f GiB, "
                "budget %.1f GiB%s)",
                n,
                len(self.layers),
                tokens,
                self.estimate.bytes(n, tokens) / gib,
                budget / gib,
                "" if fits else "; it does not fit even so: lower --micro_train_batch_size, in RL --max_tokens_per_gpu",
            )
        return None

    def budget(self) -> int:
        return free_bytes(self.module, self.device, self.optimizer)


def free_bytes(module: nn.Module, device: torch.device, optimizer=None) -> int:
    """Device memory a training forward's activations may take (module docstring): free plus what torch's
    allocator holds unused, less the gradients and Adam moments training will still allocate, less the margin;
    within this process's cap where one is set (``torch.cuda.set_per_process_memory_fraction``)."""
    free, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    cached = reserved - torch.cuda.memory_allocated(device)
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda _: 1.0)(device)
    if fraction < 1:  # this process is capped (torch.cuda.set_per_process_memory_fraction): what its cap leaves
        free = min(free, int(fraction * total) - reserved)
    grads = sum(
        p.numel() * p.element_size()
        for p in module.parameters()
        if p.requires_grad and p.grad is None and p.device.type == "cuda"
    )
    return free + cached - grads - pending_moments(optimizer) - int(MARGIN * total)


def margin_bytes(device: torch.device) -> int:
    """The ``MARGIN`` :func:`free_bytes` keeps back on ``device`` (0 off CUDA)."""
    return int(MARGIN * torch.cuda.mem_get_info(device)[1]) if device.type == "cuda" else 0


def pending_step_grads(optimizer) -> int:
    """Bytes of fp32 gradient copies DeepSpeed's unfused optimizer (ZeRO-0 over bf16 or fp16 weights) makes in each
    step: it casts every gradient to its fp32 master copy's dtype at once, before Adam, and drops them after the
    step (4 bytes a parameter on top of the weights, the masters, the moments and the gradients). 0 for the other
    optimizers (ZeRO-1/2 keep their fp32 gradients allocated from the start)."""
    groups = getattr(optimizer, "fp32_groups", None)
    if type(optimizer).__name__ != "FP16_UnfusedOptimizer" or not groups:
        return 0
    return sum(p.numel() * p.element_size() for g in groups for p in g if p.grad is None)


def pending_moments(optimizer) -> int:
    """Bytes of Adam moments (two per parameter, the parameter's dtype) the optimizer will allocate at its first
    step on the device: torch's AdamW creates them lazily, DeepSpeed's ZeRO-1/2 wrapper at initialisation."""
    opt = optimizer
    for _ in range(3):  # DeepSpeed wraps torch's optimizer (opt.optimizer)
        if isinstance(opt, torch.optim.Optimizer) or not hasattr(opt, "optimizer"):
            break
        opt = opt.optimizer
    if not isinstance(opt, torch.optim.Optimizer):
        return 0
    return sum(
        2 * p.numel() * p.element_size()
        for g in opt.param_groups
        for p in g["params"]
        if p.device.type == "cuda" and not opt.state.get(p)
    )
