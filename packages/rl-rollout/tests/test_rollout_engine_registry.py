"""The engine registry: the built-ins' entries, loud errors for bad names and clashes, and a plug-in
(one module and its entry point, as an installed package has) built by name through EngineConfig."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from rl_rollout import EngineContext, EngineSpec, engine_names, engine_spec, make_engine, register_engine
from rl_rollout.config import EngineConfig
from rl_rollout.testing import write_engine_plugin


def test_builtin_entries_state_what_the_loop_asks():
    assert engine_names()[:2] == ["vllm", "hf"]
    assert engine_spec("vllm").tensor_parallel and not engine_spec("hf").tensor_parallel
    assert engine_spec("vllm").auto_rank < engine_spec("hf").auto_rank  # auto tries vLLM first
    ctx = EngineContext(dtype="bf16", seed=3, tensor_parallel_size=2)
    opts = EngineConfig(gpu_memory_utilization=0.3).options("vllm", ctx)
    assert (opts["dtype"], opts["seed"], opts["tensor_parallel_size"]) == ("bfloat16", 3, 2)
    assert opts["engine_kwargs"] == {"gpu_memory_utilization": 0.3, "distributed_executor_backend": "mp"}
    with pytest.raises(ValueError, match="tensor parallel size 2: the HF engine runs on one GPU"):
        EngineConfig().options("hf", ctx)


def test_bad_names_and_clashes_are_refused_listing_the_valid_names():
    with pytest.raises(ValueError, match=r"unknown rollout engine 'sglang'; choose one of auto, vllm, hf"):
        engine_spec("sglang")
    with pytest.raises(ValueError, match=r"'sglang' is not one of auto, vllm, hf .*rl_rollout.engines"):
        EngineConfig(kind="sglang")
    with pytest.raises(ValueError, match="already registered"):
        register_engine(EngineSpec("hf", "somewhere:Else", lambda cfg, ctx: {}))
    with pytest.raises(ValueError, match="not 'auto'"):
        EngineSpec("auto", "m:C", lambda cfg, ctx: {})
    with pytest.raises(ValueError, match="must be 'package.module:Class'"):
        EngineSpec("x", "no_colon", lambda cfg, ctx: {})
    with pytest.raises(ImportError, match=r"engine 'ghost': cannot import 'no_such_module:Engine'"):
        EngineSpec("ghost", "no_such_module:Engine", lambda cfg, ctx: {}).load()


def test_an_engine_registered_in_code_is_built_by_name(tmp_path):
    from rl_rollout.hf_engine import HFEngine
    from rl_rollout.testing import make_tiny_model

    spec = register_engine(EngineSpec("hf-in-code", "rl_rollout.hf_engine:HFEngine",
                                      lambda cfg, ctx: cfg.hf_options(dtype=ctx.dtype, device=ctx.device)))
    assert "hf-in-code" in engine_names() and register_engine(spec) is spec  # the same entry again is fine
    model = make_tiny_model(tmp_path / "tiny")
    engine = EngineConfig(kind="hf-in-code").make(str(model), dtype="fp32", seed=0)
    assert isinstance(engine, HFEngine) and engine.dtype is not None
    assert isinstance(make_engine("hf-in-code", model), HFEngine)


def test_a_plugin_package_is_one_module_and_its_entry_point(tmp_path):
    """A fresh interpreter with the plug-in on its path lists it, and builds and runs it by name."""
    from rl_rollout.testing import make_tiny_model

    model = make_tiny_model(tmp_path / "tiny")
    plugin = write_engine_plugin(tmp_path / "site")
    script = textwrap.dedent(f"""
        from rl_rollout import RolloutRequest, SamplingParams, engine_names
        from rl_rollout.config import EngineConfig
        assert "hf-probe" in engine_names(), engine_names()
        engine = EngineConfig(kind="hf-probe").make({str(model)!r}, dtype="fp32", seed=0)
        out = engine.generate([RolloutRequest([5, 60, 70], SamplingParams(n=2, max_new_tokens=4, ignore_eos=True))])
        print(type(engine).__name__, len(out[0]), len(out[0][0].response_ids))
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(plugin), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split() == ["ProbeEngine", "2", "4"]
    assert "[hf-probe] generate 1 requests at version 0" in res.stderr
    # without the plug-in on the path the name is refused, naming the group that adds it
    res = subprocess.run([sys.executable, "-c", "from rl_rollout.config import EngineConfig; "
                          "EngineConfig(kind='hf-probe')"], capture_output=True, text=True, timeout=300)
    assert res.returncode != 0 and "entry point group rl_rollout.engines" in res.stderr
