"""How agent programs are run per episode (``--agent_cmd``): :class:`AgentCmdConfig`, read by
:class:`~rl_rollout.agents.cmd.AgentCmdRunner`; on rl-core's ``PPOConfig`` as the optional node ``agent_cmd``.

Light (no torch, no uvicorn): a command's ``--help`` reads its fields."""

from __future__ import annotations

from dataclasses import dataclass, field

from rl_rollout.config_fields import check_numbers, meta
from rl_rollout.openai_api.config import TOOL_PARSER_CHOICES, check_tool_parser


@dataclass(frozen=True)
class AgentCmdConfig:
    """The program played per episode against the run's OpenAI-compatible endpoint, and its bounds."""

    cmd: str = field(
        default="",
        metadata=meta(
            "an agent program run once per episode against the policy's OpenAI-compatible endpoint: a shell command "
            "(started with OPENAI_BASE_URL, OPENAI_API_KEY (the episode's key), OPENAI_MODEL; the dataset row as one "
            'JSON object on stdin; prints {"reward": x} on its last stdout line) or a Python entry point '
            "module:function / path.py:function (called in a thread as function(row, endpoint) and returning "
            '{"reward": x}); without a reward, --reward_fn scores the recorded transcript',
            flags=("agent_cmd",),
        ),
    )
    concurrency: int = field(default=8, metadata=meta("episodes run at once at most", flags=("agent_cmd_concurrency",)))
    timeout_s: float = field(
        default=120.0,
        metadata=meta(
            "seconds an episode may run; then its process group gets SIGTERM, then SIGKILL after "
            "--agent_cmd_kill_grace, its key is closed (later calls: 410) and its sample is dropped (counted)",
            flags=("agent_cmd_timeout",),
        ),
    )
    kill_grace_s: float = field(
        default=2.0,
        metadata=meta(
            "seconds between SIGTERM and SIGKILL of an episode's process group", flags=("agent_cmd_kill_grace",)
        ),
    )
    tool_parser: str = field(
        default="auto",
        metadata=meta(
            "how the endpoint reads tool calls in the policy's replies to requests with tools: "
            f"{' | '.join(TOOL_PARSER_CHOICES)} (auto: the chat template's format; vllm:NAME: vLLM's parser NAME); "
            "a call that does not parse goes back as content and is counted (agent_cmd/tool_parse_failures)",
            flags=("agent_cmd_tool_parser",),
        ),
    )

    def __post_init__(self) -> None:
        if not self.cmd.strip():
            raise ValueError(
                "--agent_cmd_concurrency, --agent_cmd_timeout, --agent_cmd_kill_grace and --agent_cmd_tool_parser serve "
                "agent programs: add "
                "--agent_cmd 'COMMAND' (or module:function / path.py:function), or drop them"
            )
        check_numbers(self, positive=("timeout_s",), non_negative=("kill_grace_s",), at_least_1=("concurrency",))
        check_tool_parser(self.tool_parser, "--agent_cmd_tool_parser")
