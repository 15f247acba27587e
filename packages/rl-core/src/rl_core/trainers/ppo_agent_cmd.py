"""Agent programs as the rollout (``--agent_cmd``, :class:`~rl_rollout.agents.cmd_config.AgentCmdConfig`):
:class:`AgentCmdEpisodes` serves the rollout engine as an OpenAI-compatible endpoint
(:class:`~rl_rollout.openai_api.OpenAIServer`, started on first use, stopped by :meth:`~AgentCmdEpisodes.close`),
runs the program once per sample (rl-rollout's :class:`~rl_rollout.agents.cmd.AgentCmdRunner`) and turns each
episode's recorded calls into the one training sample of its slot in the loop's prompts x n batch:

- merged (every call extends the previous call's prompt + sampled ids, token for token): the whole episode,
  the program's own tokens (tool results, user turns, template markup) with loss mask 0, the sampled ones 1;
- per call (a call that does not extend, re-tokenisation drift included: :mod:`rl_rollout.agents.transcript`):
  the episode's last call, its prompt as rendered, carrying the earlier calls in ``info["earlier_calls"]``; the
  loop trains every call, each with the episode's advantage (:mod:`rl_core.trainers.ppo_per_call`: rewards and
  group baselines count the episode once, a global batch holds its episodes' calls);
- dropped (the program failed, timed out, made no call, or gave no reward with no --reward_fn to score it):
  a placeholder of one masked token with reward 0, so nothing of it trains (counted).

Chat calls that continue their episode get their prompt spliced onto the previous call's prompt + sampled ids by
the endpoint (:mod:`rl_rollout.openai_api.splice`), so a program that keeps its transcript as text still merges.

Metrics per iteration (``agent_cmd/...``): episodes ok / failed / timed out, calls and tokens per episode, tool
calls and tool-call parse failures per episode (and the failures' total: a reply whose call did not parse went
back to the program as content), merged / per_call / drift episodes, untrained calls (0: every call trains; the
loop adds ``agent_cmd/per_call_items_added``, the items per-call episodes added), dropped samples, late calls
(410s since the last iteration), calls_spliced (chat calls whose prompt the endpoint spliced onto the previous
call's ids) and splice_refused (continuations whose splice failed its checks and were rendered instead: their
episodes count as drift).
"""

from __future__ import annotations

import logging
from typing import Any

from rl_core.trainers.ppo_per_call import EARLIER_CALLS
from rl_rollout.agents.cmd import AgentCmdRunner, EpisodeResult
from rl_rollout.agents.cmd_config import AgentCmdConfig
from rl_rollout.agents.transcript import episode_samples
from rl_rollout.openai_api import OpenAIServer, OpenAIServerConfig
from rl_rollout.openai_api.config import ToolCallConfig
from rl_rollout.types import RolloutSample

logger = logging.getLogger(__name__)


class AgentCmdEpisodes:
    """``groups(prompts, n)``: n episodes per prompt as samples (module docstring); ``last_metrics`` of the
    latest call; ``reward_fn``: whether a reward function scores episodes that print no reward."""

    def __init__(self, config: AgentCmdConfig, rollout: Any, tokenizer: Any, *, reward_fn: bool, eos: list[int]):
        if not callable(getattr(rollout, "generate", None)):
            raise ValueError(f"--agent_cmd serves an engine with generate(requests); got {type(rollout).__name__}")
        self.config, self.rollout, self.tokenizer, self.reward_fn = config, rollout, tokenizer, reward_fn
        self.filler = eos[0] if eos else 0
        self.server: OpenAIServer | None = None
        self.runner: AgentCmdRunner | None = None
        self.last_metrics: dict[str, float] = {}
        self._gone = 0

    def start(self) -> AgentCmdEpisodes:
        if self.server is None:
            server_cfg = OpenAIServerConfig(tool_calls=ToolCallConfig(parser=self.config.tool_parser))
            self.server = OpenAIServer(self.rollout, self.tokenizer, server_cfg).start()
            self.runner = AgentCmdRunner(self.config, self.server)
        return self

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
        self.server = self.runner = None

    def groups(self, prompts: list[dict], n: int) -> list[list[RolloutSample]]:
        self.start()
        assert self.runner is not None and self.server is not None
        rows = [agent_row(p) for p in prompts for _ in range(n)]
        results = self.runner.run(rows)
        counts = {k: 0.0 for k in ("ok", "failed", "timeout", "merged", "per_call", "drift", "untrained", "dropped")}
        calls = spliced = refused = tool_calls = parse_failures = 0
        samples = []
        for p, r in zip([p for p in prompts for _ in range(n)], results, strict=True):
            counts[r.status] += 1
            calls += len(r.calls)
            spliced += sum(c.prompt_source == "spliced" for c in r.calls)
            refused += sum(bool(c.splice_refused) for c in r.calls)
            tool_calls += sum(c.tool_calls for c in r.calls)
            parse_failures += sum(c.tool_parse_failures for c in r.calls)
            s, why = self._sample(p, r, counts)
            if why:
                counts["dropped"] += 1
                logger.warning("agent_cmd episode dropped (%s): %s", why, r.error or "")
            samples.append(s)
        gone = int(self.server.stats().get("gone", 0))
        k = len(results)
        parts = [c for s in samples for c in [*s.info.get(EARLIER_CALLS, ()), vars(s)]]  # every trained sequence
        self.last_metrics = {
            "agent_cmd/episodes_ok": counts["ok"],
            "agent_cmd/episodes_failed": counts["failed"],
            "agent_cmd/episodes_timed_out": counts["timeout"],
            "agent_cmd/calls_per_episode": calls / k,
            "agent_cmd/tool_calls_per_episode": tool_calls / k,
            "agent_cmd/tool_parse_failures_per_episode": parse_failures / k,
            "agent_cmd/tool_parse_failures": float(parse_failures),
            "agent_cmd/tokens_per_episode": sum(len(c["prompt_ids"]) + len(c["response_ids"]) for c in parts) / k,
            "agent_cmd/policy_tokens_per_episode": sum(sum(c["loss_mask"]) for c in parts) / k,
            "agent_cmd/merged": counts["merged"],
            "agent_cmd/per_call": counts["per_call"],
            "agent_cmd/drift": counts["drift"],
            "agent_cmd/calls_spliced": float(spliced),
            "agent_cmd/splice_refused": float(refused),
            "agent_cmd/calls_untrained": counts["untrained"],
            "agent_cmd/dropped": counts["dropped"],
            "agent_cmd/late_calls": float(gone - self._gone),
        }
        self._gone = gone
        return [samples[i * n : (i + 1) * n] for i in range(len(prompts))]

    def _sample(self, prompt: dict, r: EpisodeResult, counts: dict[str, float]) -> tuple[RolloutSample, str]:
        """The slot's sample and, when it is a dropped placeholder, why."""
        why = ""
        if r.status != "ok":
            why = f"{r.status}"
        elif not r.calls:
            why = "no call"
        elif r.reward is None and not self.reward_fn:
            why = "no reward printed and no --reward_fn"
        if why:
            return self._placeholder(prompt, r, why), why
        es = episode_samples(r.calls, self.tokenizer)
        counts[es.mode] += 1
        counts["drift"] += es.drift
        if es.mode == "merged":
            s = es.samples[0]
        else:  # every call trains: the earlier ones as plain lists beside the slot's sample (ppo_per_call)
            s = es.samples[-1]
            s.info[EARLIER_CALLS] = [
                {
                    "prompt_ids": list(c.prompt_ids),
                    "response_ids": list(c.response_ids),
                    "loss_mask": list(c.loss_mask),
                    "rollout_logprobs": list(c.rollout_logprobs),
                }
                for c in es.samples[:-1]
            ]
        s.reward = r.reward
        s.info.update(
            agent_cmd=r.status,
            mode=es.mode,
            drift=es.drift,
            calls=len(r.calls),
            tool_calls=sum(c.tool_calls for c in r.calls),
            tool_parse_failures=sum(c.tool_parse_failures for c in r.calls),
            dropped=False,
        )
        return s, ""

    def _placeholder(self, prompt: dict, r: EpisodeResult, why: str) -> RolloutSample:
        return RolloutSample(
            prompt_ids=list(prompt["prompt_ids"]),
            response_ids=[self.filler],
            rollout_logprobs=[0.0],
            loss_mask=[0],
            finish_reason="abort",
            policy_version=getattr(self.rollout, "policy_version", 0),
            reward=0.0,
            info={"agent_cmd": r.status, "dropped": True, "why": why, "calls": len(r.calls), "error": r.error},
        )


def agent_row(prompt: dict) -> dict:
    """What the program reads: the dataset row as in the file (every key), ``prompt`` its prompt as written
    there and ``label`` its label."""
    row = dict(prompt.get("row") or {})
    row.setdefault("prompt", prompt.get("prompt"))
    row.setdefault("label", prompt.get("label"))
    return row
