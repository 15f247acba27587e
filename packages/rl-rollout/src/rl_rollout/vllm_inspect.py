"""What a vLLM worker holds, read the way its kernels read it (used by ``WorkerExtension.rl_weight_stats``).

What the engine holds (``rl_weight_stats``): per HF name, the element count and float64 sum and
sum of squares (:class:`rl_rollout.weights.TensorStats`) of the values the kernels compute with.
On CPU a linear layer's parameter is emptied once its weight is packed for oneDNN (or the
sgl-kernel), and the LM head keeps a live parameter next to a packed copy, so the values are read
through the layer's kernel, ``cpu_linear``, applied to identity rows (exact: each output is one
weight times 1, sums of zeros): ``eye(K) @ W.T``, K the input size, in chunks. Elsewhere the
parameters are read directly. Fused layers are split back per HF name (``qkv_proj`` into q/k/v
rows, ``gate_up_proj`` into gate/up), the vocabulary's padding rows are left out, and sums of a
shard are marked ``shard`` (added over tensor-parallel workers by the engine) or ``replica``.
Imported inside vLLM workers only: vLLM imports stay inside functions.
"""

from __future__ import annotations

import torch

_PROBE_BYTES = 64 << 20  # output of one identity-probe chunk of a packed CPU linear layer


class Unsupported(Exception):
    """A name whose values this worker cannot report (the reason is the message)."""


class Dropped(Unsupported):
    """A name the engine's model leaves out by design: vLLM builds it without that layer (the attribute is None) and
    its loader skips the checkpoint's tensors for it, e.g. a CLIP tower's ``post_layernorm`` under LLaVA, whose
    features are taken before it."""


def _dropped_by_the_model(model, module_name: str) -> bool:
    """Whether a module on ``module_name``'s path is None in ``model`` (vLLM built the model without it)."""
    mod = model
    for part in module_name.split("."):
        if not hasattr(mod, part):
            return False
        mod = getattr(mod, part)
        if mod is None:
            return True
    return False


def param_stats(model, hf_name, mapper, packed, dtype, rows_cache) -> list:
    """``[numel, sum, sumsq, combine]`` of the values this worker holds for ``hf_name``."""
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    shard = None
    if mapper is not None and hasattr(mapper, "_map_name_with_shard"):
        mapped = mapper._map_name_with_shard(hf_name)
        if mapped is None:
            raise Unsupported("the model's weight mapper drops this name")
        vname, shard = mapped
    else:
        vname = hf_name
    if shard is None:  # fused modules named by packed_modules_mapping instead of the mapper
        for fused, part, i in ((f, p, i) for f, parts in packed.items() for i, p in enumerate(parts)):
            if f".{part}." in f".{vname}":
                vname = f".{vname}".replace(f".{part}.", f".{fused}.", 1)[1:]
                shard = i
                break
    if isinstance(shard, list):
        raise Unsupported(f"loaded into several shards {shard}")
    module_name, _, pname = vname.rpartition(".")
    try:
        module = model.get_submodule(module_name) if module_name else model
    except AttributeError:
        if _dropped_by_the_model(model, module_name):
            raise Dropped(f"the engine's model leaves {module_name!r} out (None in vLLM's model)") from None
        raise Unsupported(f"the engine has no module {module_name!r}") from None
    if not isinstance(getattr(module, pname, None), torch.Tensor):
        raise Unsupported(f"the engine has no parameter {vname!r}")
    key = f"{module_name}.{pname}"
    if key not in rows_cache:
        rows_cache[key] = _row_sums(module, pname, dtype)
    row_sum, row_sumsq, width = rows_cache[key]

    n_rows = row_sum.numel()
    tp = getattr(module, "tp_size", 1) or 1
    combine = "shard" if tp > 1 else "replica"
    scale = 1.0
    lo, hi = 0, n_rows
    if isinstance(module, VocabParallelEmbedding):
        hi = module.shard_indices.num_org_elements  # the padding rows are not the checkpoint's
    elif isinstance(module, RowParallelLinear) and pname == "bias":
        combine = "replica"  # the full bias on every rank
    elif shard is not None:
        if isinstance(module, QKVParallelLinear) and shard in (0, 1, 2, "q", "k", "v"):
            shard = "qkv"[shard] if isinstance(shard, int) else shard
            lo = module._get_shard_offset_mapping(shard)
            hi = lo + module._get_shard_size_mapping(shard)
            if shard != "q":
                scale = 1.0 / getattr(module, "num_kv_head_replicas", 1)  # a kv head on several ranks
        elif isinstance(module, MergedColumnParallelLinear) and isinstance(shard, int):
            sizes = [size // tp for size in module.output_sizes]
            lo = sum(sizes[:shard])
            hi = lo + sizes[shard]
        else:
            raise Unsupported(f"shard {shard!r} of {type(module).__name__} is not understood here")
    if hi > n_rows:
        raise Unsupported(f"rows {lo}:{hi} of a {n_rows}-row tensor")
    return [
        (hi - lo) * width * scale,
        row_sum[lo:hi].sum().item() * scale,
        row_sumsq[lo:hi].sum().item() * scale,
        combine,
    ]


def _row_sums(module, pname: str, dtype) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Per output row (dim 0): float64 sums and sums of squares of the parameter's values, and the row width."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    cpu_linear = getattr(module, "cpu_linear", None)
    param = getattr(module, pname)
    # an input embedding gets a packed copy too, but looks tokens up in its parameter
    lookup = isinstance(module, VocabParallelEmbedding) and not isinstance(module, ParallelLMHead)
    if pname == "weight" and callable(cpu_linear) and not lookup:
        # CPU: the values the kernel computes with (module docstring)
        k = getattr(module, "input_size_per_partition", None) or getattr(module, "embedding_dim", None)
        if not k:
            raise Unsupported(f"{type(module).__name__} has a packed CPU weight of unknown input size")
        row_sum = row_sumsq = None
        chunk = min(k, 64)  # then as many rows as fit _PROBE_BYTES of output
        i = 0
        while i < k:
            c = min(chunk, k - i)
            x = torch.zeros(c, k, dtype=dtype, device=param.device)
            x[torch.arange(c), torch.arange(i, i + c)] = 1
            y = cpu_linear(x, param, None).double()  # [c, N] = W[:, i:i+c].T
            if row_sum is None:
                row_sum = torch.zeros(y.shape[-1], dtype=torch.float64, device=y.device)
                row_sumsq = torch.zeros_like(row_sum)
                chunk = max(1, min(k, _PROBE_BYTES // (8 * max(y.shape[-1], 1))))
            row_sum += y.sum(0)
            row_sumsq += y.square().sum(0)
            i += c
        if row_sum is None or row_sumsq is None:  # not reached: k >= 1, so the loop ran
            raise Unsupported(f"{type(module).__name__}: no rows of its packed CPU weight were probed (k={k})")
        return row_sum, row_sumsq, k
    if param.is_meta or param.numel() == 0:
        raise Unsupported(f"{type(module).__name__}.{pname} holds no values here ({tuple(param.shape)})")
    if param.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        raise Unsupported(f"{type(module).__name__}.{pname} is stored as {param.dtype} (quantized?)")
    rows = param.detach().reshape(param.shape[0], -1) if param.ndim else param.detach().reshape(1, 1)
    row_sum = torch.zeros(rows.shape[0], dtype=torch.float64, device=rows.device)
    row_sumsq = torch.zeros_like(row_sum)
    step = max(1, (1 << 24) // max(rows.shape[1], 1))
    for i in range(0, rows.shape[0], step):
        part = rows[i : i + step].double()
        row_sum[i : i + step] = part.sum(1)
        row_sumsq[i : i + step] = part.square().sum(1)
    return row_sum, row_sumsq, rows.shape[1]
