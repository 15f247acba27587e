"""use_liger_kernel on the model loaders (rl_core.liger): a one-line error before any weights
load where liger-kernel or CUDA is missing; on CUDA with liger-kernel, the patched tiny Llama
computes the plain model's log-probs and gradients."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from rl_core.models import Actor, Critic
from rl_rollout.testing import make_tiny_model

HAS_LIGER = importlib.util.find_spec("liger_kernel") is not None
HAS_CUDA = torch.cuda.is_available()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("m") / "tiny", peaked=True)


@pytest.mark.skipif(HAS_LIGER and HAS_CUDA, reason="liger-kernel and CUDA are both here: the flag works")
@pytest.mark.parametrize("cls", [Actor, Critic])
def test_missing_liger_or_cuda_is_a_one_line_error(tiny, cls):
    want = "liger-kernel is not installed" if not HAS_LIGER else "need a CUDA device"
    with pytest.raises(RuntimeError, match=rf"use_liger_kernel \(--use_liger_kernel\): {want}.*drop the flag") as e:
        cls.from_pretrained(tiny, dtype="fp32", use_liger_kernel=True)
    assert "\n" not in str(e.value)


@pytest.mark.skipif(not (HAS_LIGER and HAS_CUDA), reason="needs liger-kernel and a CUDA device")
def test_liger_patched_actor_matches_the_plain_one_on_cuda(tiny):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 100, (2, 24), generator=g).cuda()
    plain = Actor.from_pretrained(tiny, dtype="fp32").cuda()
    lp_plain = plain(ids).logprobs
    lp_plain.sum().backward()
    grad_plain = {n: p.grad.clone() for n, p in plain.named_parameters() if p.grad is not None}
    liger = Actor.from_pretrained(tiny, dtype="fp32", use_liger_kernel=True).cuda()
    # liger binds its forwards onto the module instances (RMSNorm, SwiGLU MLP)
    bound = {m.forward.__func__.__qualname__ for m in liger.modules() if "forward" in vars(m)}
    assert {q.split(".")[0] for q in bound} >= {"LigerRMSNorm", "LigerSwiGLUMLP"}, bound
    lp = liger(ids).logprobs
    lp.sum().backward()
    torch.testing.assert_close(lp, lp_plain, atol=1e-4, rtol=0)
    for n, p in liger.named_parameters():
        torch.testing.assert_close(p.grad, grad_plain[n], atol=1e-4, rtol=1e-3, msg=n)
