"""The multi-turn environment contract, its step record, and a chat-turn wrapper for observations.

An :class:`Environment` gets text: the executor decodes the policy's sampled
tokens to hand it an action, and tokenizes the observation it returns. An
observation may also carry images (``StepResult.images``, or an
:class:`Observation` from ``reset``) for a vision-language policy: the executor
puts each image's placeholder tokens in the context (:mod:`rl_rollout.agents.images`).
Environments know nothing of tokenizers or engines. :class:`ChatTurnFormat`
turns a plain observation into a chat turn of the tokenizer's own template
(``<|im_start|>tool ... <|im_end|>`` plus the next assistant header), so an
environment can stay template-agnostic. Not here: the turn loop (see
:mod:`rl_rollout.agents.executor`) and any concrete environment.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass
class StepResult:
    """What an environment answers to one action.

    ``observation`` is the text the policy sees next (ignored when ``done``:
    nothing is generated after it). ``reward`` is this step's reward; the
    episode's reward is the sum over steps. ``info`` is free-form and is kept,
    per step, in the sample's ``info["env_info"]``. ``images``: images the
    policy sees with the observation (a screenshot ...: PIL images, local paths,
    bytes, anything :func:`rl_rollout.vision.load_images` takes), in order; each
    goes where the observation text writes the model's image token (LLaVA's
    ``<image>``), or, when the text writes none, before the text. Only a
    vision-language policy takes them (the executor refuses them otherwise).
    """

    observation: str
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    images: list[Any] = field(default_factory=list)


@dataclass
class Observation:
    """An initial observation with images, what ``reset`` may return instead of a string."""

    text: str
    images: list[Any] = field(default_factory=list)


@runtime_checkable
class Environment(Protocol):
    """One episode of a multi-turn task; a fresh object per trajectory (``env_factory()``).

    ``reset`` gets the task's prompt text (``None`` when the caller gave only
    token ids), its label and the request's metadata as keywords, and may
    return an initial observation (appended after the prompt, loss mask 0: a
    string, or an :class:`Observation` with images) or ``None``. ``step`` gets the decoded text of one policy turn. An optional
    ``close()`` (plain or async) is called once the episode ends, also on error.
    """

    async def reset(self, prompt: str | None, label: Any, **info: Any) -> str | Observation | None: ...

    async def step(self, action_text: str) -> StepResult: ...


SENTINEL = "\x00OBSERVATION\x00"


@dataclass(frozen=True)
class ChatTurnFormat:
    """``prefix + observation + suffix``: an observation rendered as a chat turn.

    The policy's turn ends at its end-of-turn token (the stop token, kept in the
    response), so ``prefix`` starts right after that token: whatever the template
    puts between an assistant turn's end and the next message (``"\\n"`` for
    ChatML), the new turn's header, and ``suffix`` closes it and opens the next
    assistant turn. Build it with :meth:`from_tokenizer`.
    """

    prefix: str
    suffix: str

    def __call__(self, observation: str) -> str:
        return self.prefix + observation + self.suffix

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, role: str = "tool", end_of_turn: str | None = None) -> ChatTurnFormat:
        """Read the pieces from ``tokenizer.apply_chat_template``.

        Renders a one-exchange conversation with and without a ``role`` message
        after it; the difference, cut at the last ``end_of_turn`` (default: the
        tokenizer's EOS token) of the shorter rendering, is the turn.
        """
        eot = end_of_turn if end_of_turn is not None else tokenizer.eos_token
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                f"{type(tokenizer).__name__} has no chat_template; format observations yourself or keep them plain"
            )
        base = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
        short = tokenizer.apply_chat_template(base, tokenize=False)
        full = tokenizer.apply_chat_template(
            base + [{"role": role, "content": SENTINEL}], tokenize=False, add_generation_prompt=True
        )
        if not full.startswith(short):
            raise ValueError(
                f"the chat template renders earlier turns differently once a {role!r} message follows; "
                "ChatTurnFormat cannot cut out one turn: format observations in the environment instead"
            )
        cut = short.rfind(eot) + len(eot) if eot and eot in short else len(short)
        turn = full[cut:]
        if turn.count(SENTINEL) != 1:
            raise ValueError(
                f"the chat template dropped or repeated a {role!r} message's content (rendered {turn!r}); "
                "try role='user'"
            )
        prefix, suffix = turn.split(SENTINEL)
        return cls(prefix=prefix, suffix=suffix)
