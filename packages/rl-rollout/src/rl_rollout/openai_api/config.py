"""How the OpenAI-compatible endpoint listens, batches and bounds its requests: :class:`OpenAIServerConfig`.

Light (no torch, no uvicorn): a command's ``--help`` may read its fields."""

from __future__ import annotations

from dataclasses import dataclass, field

from rl_rollout.config_fields import meta

#: the ``tool_parser`` values (rl_rollout.openai_api.tool_parsers.PARSER_CHOICES; repeated so this module stays light)
TOOL_PARSER_CHOICES = ("auto", "hermes", "llama3_json", "mistral", "vllm:NAME")


def check_tool_parser(name: str, flag: str = "tool_parser") -> None:
    """ValueError naming ``name`` and the choices unless it is one of :data:`TOOL_PARSER_CHOICES`."""
    if name in TOOL_PARSER_CHOICES[:-1] or (name.startswith("vllm:") and len(name) > 5):
        return
    raise ValueError(
        f"{flag}={name!r} is not a tool-call parser; choose one of {', '.join(TOOL_PARSER_CHOICES)} (vllm:NAME: "
        "vLLM's parser NAME, e.g. vllm:hermes, on the vLLM engine)"
    )


@dataclass(frozen=True)
class ToolCallConfig:
    """How the endpoint reads tool calls in the model's replies (:mod:`rl_rollout.openai_api.tool_parsers`)."""

    parser: str = field(
        default="auto",
        metadata=meta(
            "tool-call format of the model's replies: auto (from the chat template: <tool_call> -> hermes, "
            "[TOOL_CALLS] -> mistral, <|python_tag|> / Llama 3 headers -> llama3_json; on the vLLM engine vLLM's "
            "parser of that name where it builds), hermes (Qwen2.5 / Hermes), llama3_json, mistral, or vllm:NAME"
        ),
    )

    def __post_init__(self) -> None:
        check_tool_parser(self.parser)


@dataclass(frozen=True)
class OpenAIServerConfig:
    """The settings of an :class:`~rl_rollout.openai_api.server.OpenAIServer` (an agent program's endpoint)."""

    host: str = field(
        default="127.0.0.1",
        metadata=meta("address to listen on (0.0.0.0: every interface; then anyone who reaches the machine can call)"),
    )
    port: int = field(default=0, metadata=meta("port to listen on (0: any free one; the server's url says which)"))
    model_name: str = field(
        default="policy", metadata=meta("the model id GET /v1/models lists; requests may name it or any other")
    )
    max_request_bytes: int = field(default=1 << 20, metadata=meta("largest request body; larger ones get 413"))
    max_concurrent_requests: int = field(
        default=256, metadata=meta("requests served at once (all episodes together); more get 503 + Retry-After")
    )
    request_timeout_s: float = field(
        default=300.0,
        metadata=meta("seconds a request may take (body, queue and generation); slower ones get 504, not recorded"),
    )
    batch_window_ms: float = field(
        default=5.0,
        metadata=meta("requests arriving within this many ms of the first waiting one go to the engine as one batch"),
    )
    max_batch_requests: int = field(default=64, metadata=meta("most requests in one engine call"))
    default_max_tokens: int = field(
        default=256, metadata=meta("new tokens of a request that names neither max_tokens nor max_completion_tokens")
    )
    max_tokens_limit: int = field(
        default=4096, metadata=meta("largest max_tokens / max_completion_tokens a request may ask; more get 400")
    )
    max_n: int = field(default=16, metadata=meta("largest n (choices per request); more get 400"))
    max_model_len: int | None = field(
        default=None,
        metadata=meta(
            "most prompt + new tokens of a request; more get 400 (None: the engine's model's max_position_embeddings "
            "where it has one)"
        ),
    )
    tool_calls: ToolCallConfig = field(
        default_factory=ToolCallConfig, metadata=meta("how tool calls in the replies are parsed")
    )

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be 0..65535, got {self.port}")
        for name in (
            "max_request_bytes",
            "max_concurrent_requests",
            "max_batch_requests",
            "default_max_tokens",
            "max_tokens_limit",
            "max_n",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.max_model_len is not None and (
            not isinstance(self.max_model_len, int) or isinstance(self.max_model_len, bool) or self.max_model_len < 2
        ):
            raise ValueError(f"max_model_len must be an int >= 2 or None, got {self.max_model_len!r}")
        if self.default_max_tokens > self.max_tokens_limit:
            raise ValueError(
                f"default_max_tokens={self.default_max_tokens} exceeds max_tokens_limit={self.max_tokens_limit}; "
                "lower the first or raise the second"
            )
        if not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0 seconds, got {self.request_timeout_s!r}")
        if not 0 <= self.batch_window_ms <= 1000:
            raise ValueError(f"batch_window_ms must be in [0, 1000], got {self.batch_window_ms!r}")
        if not self.model_name:
            raise ValueError("model_name must be a non-empty string")
