"""CopyPlan: a loader's copies recorded once and replayed as one fused copy, on a module whose loader
does what vLLM's do (fused qkv rows, a tensor-parallel shard of the input, tied weights), plus loaders
it must leave alone (computed values, nothing written) and the staleness checks."""

from __future__ import annotations

import pytest
import torch

from rl_rollout.copy_plan import CopyPlan, CopyPlanStale

H, KV = 8, 4


class FusedModel(torch.nn.Module):
    """q/k/v land in one qkv weight; 'up' arrives twice as wide and the loader keeps the second half (a
    TP rank's shard); 'scale' is computed (x 2) before the copy; 'unused' is dropped; embed/head are tied."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Parameter(torch.zeros(H + 2 * KV, H))
        self.up = torch.nn.Parameter(torch.zeros(H, H))
        self.scale = torch.nn.Parameter(torch.zeros(H))
        self.embed = torch.nn.Parameter(torch.zeros(16, H))
        self.head = self.embed  # tied: one parameter
        self.register_buffer("norm", torch.zeros(H))

    def load_weights(self, weights):
        rows = {"q": (0, H), "k": (H, KV), "v": (H + KV, KV)}
        with torch.no_grad():
            for name, t in weights:
                if name in rows:
                    start, n = rows[name]
                    self.qkv.data.narrow(0, start, n).copy_(t)
                elif name == "up":
                    self.up.data.copy_(t.narrow(0, H, H))
                elif name == "scale":
                    self.scale.data.copy_(t * 2)
                elif name == "embed":
                    self.embed.data.copy_(t)
                elif name == "norm":
                    self.norm.copy_(t)


def weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return [("q", r(H, H)), ("k", r(KV, H)), ("v", r(KV, H)), ("up", r(2 * H, H)), ("scale", r(H)),
            ("embed", r(16, H)), ("norm", r(H)), ("unused", r(3))]


def params_of(m):
    return {**dict(m.named_parameters(remove_duplicate=False)), **dict(m.named_buffers())}


def state(m):
    return {n: p.detach().clone() for n, p in params_of(m).items()}


def test_replay_writes_what_the_loader_writes_and_leaves_the_rest_to_it():
    m, ref = FusedModel(), FusedModel()
    plan = CopyPlan.record(m.load_weights, weights(0), params_of(m))
    ref.load_weights(weights(0))
    assert all(torch.equal(a, state(ref)[n]) for n, a in state(m).items())  # recording loads the weights
    assert set(plan.entries) == {"q", "k", "v", "up", "embed", "norm"}
    assert set(plan.skipped) == {"scale", "unused"}
    assert "computes what it copies" in plan.skipped["scale"] and "copied nothing" in plan.skipped["unused"]
    assert plan.copies == 6

    new = weights(1)
    rest = plan.replay(new)
    assert [n for n, _ in rest] == ["scale", "unused"] and plan.last_copies == 6
    m.load_weights(rest)
    ref.load_weights(new)
    for n, a in state(m).items():
        assert torch.equal(a, state(ref)[n]), n
    assert torch.equal(m.head, new[5][1])  # the tied head follows its source


def test_a_non_contiguous_input_replays_through_its_strides():
    m, ref = FusedModel(), FusedModel()
    plan = CopyPlan.record(m.load_weights, [("up", torch.randn(H, 2 * H).t())], params_of(m))
    new = torch.randn(H, 2 * H).t()  # the same layout, other values
    assert plan.replay([("up", new)]) == []
    ref.load_weights([("up", new)])
    assert torch.equal(m.up, ref.up)


def test_a_stale_plan_is_refused_never_written_through():
    m = FusedModel()
    plan = CopyPlan.record(m.load_weights, weights(0), params_of(m))
    with pytest.raises(CopyPlanStale, match=r"q: \(8, 4\)"):
        plan.replay([("q", torch.zeros(H, 4))])
    with pytest.raises(CopyPlanStale, match="float64"):
        plan.replay([("k", torch.zeros(KV, H, dtype=torch.float64))])
    m.qkv.data = torch.zeros_like(m.qkv)  # the engine re-allocated a parameter
    with pytest.raises(CopyPlanStale, match="parameter qkv is no longer the storage"):
        plan.check_params(params_of(m))


def test_a_loader_writing_through_another_op_is_left_to_the_loader():
    class Filling(FusedModel):
        def load_weights(self, weights):
            for name, t in weights:
                if name == "norm":
                    self.norm.fill_(float(t.sum()))
                else:
                    super().load_weights([(name, t)])

    m = Filling()
    plan = CopyPlan.record(m.load_weights, weights(0), params_of(m))
    assert "fill_" in plan.skipped["norm"] and "q" in plan.entries


def test_a_sync_in_groups_is_recorded_group_by_group():
    m, ref = FusedModel(), FusedModel()
    first, second = weights(0)[:3], weights(0)[3:]
    plan = CopyPlan.record(m.load_weights, first, params_of(m))
    assert [n for n, _ in plan.replay(second)] == [n for n, _ in second]  # not recorded yet: returned
    plan.add(m.load_weights, second, params_of(m))
    assert set(plan.entries) == {"q", "k", "v", "up", "embed", "norm"} and plan.record_s > 0
    new = weights(2)
    m.load_weights(plan.replay(new[:3]) + plan.replay(new[3:]))
    ref.load_weights(new)
    assert all(torch.equal(a, state(ref)[n]) for n, a in state(m).items())


def test_live_inputs_replay_through_kept_views_until_one_moves():
    m, ref = FusedModel(), FusedModel()
    live = weights(0)  # a trainer's parameters: the same tensors (storage) at every sync
    plan = CopyPlan.record(m.load_weights, live, params_of(m))
    for step in range(3):
        for _, t in live:
            t.mul_(1.5).add_(step)  # the optimizer updates them in place
        rest = plan.replay(live, live=True)
        assert plan._live_views is not None and plan.last_copies == 6
        m.load_weights(rest)
        ref.load_weights(live)
        assert all(torch.equal(a, state(ref)[n]) for n, a in state(m).items()), step
    kept = plan._live_views
    plan.replay(live, live=True)
    assert plan._live_views is kept  # the same tensors at the same addresses: the kept views
    plan.replay([(n, t.detach()) for n, t in live], live=True)  # same memory, other tensor objects: not trusted
    assert plan._live_views is not kept
    plan.replay(live, live=True)
    kept = plan._live_views
    moved = [(n, t.clone()) if n == "q" else (n, t) for n, t in live]  # one parameter got new storage
    m.load_weights(plan.replay(moved, live=True))
    ref.load_weights(moved)
    assert plan._live_views is not kept  # rebuilt, not written from the old storage
    assert all(torch.equal(a, state(ref)[n]) for n, a in state(m).items())
    plan.replay(moved)  # not live: nothing kept (a ZeRO-3 gather's copies must be freed)
    assert plan._live_views is None


def test_an_empty_write_is_not_a_write():
    """vLLM's embedding loader zero-fills the padding rows after the copy; with no padding the fill hits an
    empty view of the parameter and must not keep the tensor out of the plan."""
    class Padded(FusedModel):
        def load_weights(self, weights):
            for name, t in weights:
                if name == "embed":
                    self.embed.data[: t.shape[0]].copy_(t)
                    self.embed.data[t.shape[0]:].fill_(0)
                else:
                    super().load_weights([(name, t)])

    m = Padded()
    plan = CopyPlan.record(m.load_weights, weights(0), params_of(m))
    assert "embed" in plan.entries
    m2 = Padded()
    plan2 = CopyPlan.record(m2.load_weights, [("embed", torch.randn(12, H))], params_of(m2))
    assert "fill_" in plan2.skipped["embed"]  # real padding rows: a write the plan cannot replay


def test_a_param_index_stays_current_until_something_is_replaced():
    """ParamIndex: reused while every module, parameter and buffer is the registered one at the same address;
    each kind of replacement makes it stale (then the worker looks the parameters up again)."""
    from rl_rollout.copy_plan import ParamIndex

    def model():
        m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Sequential(torch.nn.LayerNorm(4), torch.nn.Linear(4, 2)))
        m.register_buffer("scale", torch.ones(2))
        return m

    m = model()
    index = ParamIndex(m)
    assert index.params.keys() == {"0.weight", "0.bias", "1.0.weight", "1.0.bias", "1.1.weight", "1.1.bias", "scale"}
    with torch.no_grad():  # what a sync does: values change in place
        for t in index.params.values():
            t.mul_(2.0)
    assert index.current()

    def stale_after(change):
        m = model()
        index = ParamIndex(m)
        change(m)
        return not index.current()

    def set_data(m):
        m[0].weight.data = torch.zeros(4, 4)

    assert stale_after(lambda m: setattr(m[0], "weight", torch.nn.Parameter(torch.zeros(4, 4))))
    assert stale_after(set_data)  # same Parameter object, new storage
    assert stale_after(lambda m: setattr(m, "scale", torch.zeros(2)))  # a buffer
    assert stale_after(lambda m: m[1].__setitem__(1, torch.nn.Linear(4, 2)))  # a whole submodule
    assert not stale_after(lambda m: m.add_module("extra", torch.nn.Linear(2, 2)))  # added: the old ones still hold
