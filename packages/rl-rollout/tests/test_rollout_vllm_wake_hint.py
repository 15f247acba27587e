"""The fix an engine that cannot wake up names (no vLLM needed: the arithmetic of the error message).

On a GPU, a sleeping vLLM engine maps its memory back on wake-up; if the trainer beside it holds too much,
vLLM runs out of memory (seen on an H100: `rl ppo-ray`'s hybrid engine at the 1.5B shape with the default
share). The error then says which ``--vllm_gpu_memory_utilization`` fits in what is free at that moment."""

from __future__ import annotations

from rl_rollout.vllm_engine import wake_oom_hint

GiB = 2**30


def test_the_hint_names_a_share_that_fits_in_what_is_free():
    hint = wake_oom_hint(0.5, free=int(29.9 * GiB), total=80 * GiB)  # 0.374 of the device free
    assert "--vllm_gpu_memory_utilization 0.35 or lower" in hint and "it is 0.50" in hint, hint
    assert "--deepspeed_enable_sleep" in hint


def test_without_room_the_hint_is_deepspeed_sleep_alone():
    hint = wake_oom_hint(0.3, free=2 * GiB, total=80 * GiB)
    assert "--vllm_gpu_memory_utilization" not in hint and "--deepspeed_enable_sleep" in hint, hint


def test_without_a_device_reading_the_hint_still_names_both_flags():
    hint = wake_oom_hint(None, None, None)
    assert "lower --vllm_gpu_memory_utilization (now vLLM's default)" in hint and "--deepspeed_enable_sleep" in hint
