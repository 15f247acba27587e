"""``CalculatorEnv``: the worked example environment, a calculator tool and a checked final answer.

The policy writes ``<calc>2+3*4</calc>`` and sees ``<result>14</result>``, or
``<answer>14</answer>`` to end the episode: reward 1.0 if the answer equals
the label (numerically, else as stripped text), 0.0 otherwise. Expressions are
evaluated by :func:`safe_eval`, which walks the ``ast`` of numbers, ``+ - * /
**``, unary signs and parentheses, and refuses everything else (names, calls,
attributes, ``__import__``...): no ``eval``. A bad expression is an error
observation, never an exception. Not here: other tools, partial credit.
"""

from __future__ import annotations

import ast
import math
import operator
import re
from collections.abc import Callable
from typing import Any

from rl_rollout.agents.env import StepResult

CALC_RE = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)

MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 100
MAX_MAGNITUDE = 1e100

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[int | float], int | float]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalcError(ValueError):
    """An expression :func:`safe_eval` refuses or cannot compute; the message is shown to the policy."""


def safe_eval(expression: str) -> int | float:
    """The value of an arithmetic expression, or :class:`CalcError` saying what is not allowed.

    Allowed: int and float literals, ``+ - * / **``, unary ``+ -``,
    parentheses. Bounds keep one call cheap: at most ``MAX_EXPRESSION_CHARS``
    characters, exponents of at most ``MAX_EXPONENT`` in size, intermediate
    values of at most ``MAX_MAGNITUDE``.
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalcError(f"expression has {len(expression)} characters, the limit is {MAX_EXPRESSION_CHARS}")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise CalcError(f"not an arithmetic expression: {expression.strip()!r}") from None
    return _eval(tree.body)


def _eval(node: ast.AST) -> int | float:
    # an int or a float, not a bool (an int too) nor a complex
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Div) and right == 0:
            raise CalcError("division by zero")
        if isinstance(node.op, ast.Pow):
            if abs(right) > MAX_EXPONENT:
                raise CalcError(f"exponent {right} is larger than {MAX_EXPONENT} in size")
            if left == 0 and right < 0:
                raise CalcError("zero to a negative power")
            if left < 0 and not float(right).is_integer():
                raise CalcError("negative number to a fractional power")
        try:
            return _checked(_BINARY[type(node.op)](left, right))
        except OverflowError:
            raise CalcError(f"result is larger than {MAX_MAGNITUDE:g}") from None
    allowed = "numbers, + - * / **, parentheses"
    raise CalcError(f"{type(node).__name__} is not allowed in a calculation ({allowed})")


def _checked(value: int | float) -> int | float:
    if (isinstance(value, float) and not math.isfinite(value)) or abs(value) > MAX_MAGNITUDE:
        raise CalcError(f"result is larger than {MAX_MAGNITUDE:g}")
    return value


def format_number(value: int | float) -> str:
    """``14`` for 14 and 14.0, ``3.5`` for 3.5: integral floats print as ints, others to 12 significant digits."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return f"{value:.12g}" if isinstance(value, float) else str(value)


def answers_match(answer: str, label: Any, rel_tol: float = 1e-6) -> bool:
    """Numeric comparison when both sides are numbers, else stripped string equality."""
    a, b = answer.strip(), str(label).strip()
    try:
        return math.isclose(float(a), float(b), rel_tol=rel_tol, abs_tol=1e-12)
    except ValueError:
        return a == b


class CalculatorEnv:
    """Environment: ``<calc>expr</calc>`` -> ``<result>value</result>``; ``<answer>x</answer>`` ends the episode.

    An action with an answer tag is final (reward 1.0 if it matches the label,
    else 0.0), even if it also holds a calculation. Otherwise the first
    ``<calc>`` tag is evaluated (``<error>...</error>`` when refused); an
    action with neither tag gets a hint. Only a correct answer pays: an
    episode cut by the executor's ``max_turns`` earns 0.
    """

    def __init__(self) -> None:
        self.label: Any = None
        self.calls = 0

    async def reset(self, prompt: str | None, label: Any, **info: Any) -> str | None:
        if label is None:
            raise ValueError("CalculatorEnv needs a label (the expected answer) in the request")
        self.label, self.calls = label, 0
        return None

    async def step(self, action_text: str) -> StepResult:
        if (m := ANSWER_RE.search(action_text)) is not None:
            correct = answers_match(m.group(1), self.label)
            return StepResult("", reward=1.0 if correct else 0.0, done=True, info={"answer": m.group(1).strip()})
        if (m := CALC_RE.search(action_text)) is not None:
            self.calls += 1
            try:
                value = format_number(safe_eval(m.group(1)))
            except CalcError as e:
                return StepResult(f"<error>{e}</error>", info={"calc": m.group(1), "error": str(e)})
            return StepResult(f"<result>{value}</result>", info={"calc": m.group(1), "result": value})
        hint = "<error>no <calc>expression</calc> or <answer>value</answer> found</error>"
        return StepResult(hint, info={"error": "no tag"})
