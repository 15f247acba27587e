"""Built-in verifiers: exact match, math answer (math-verify's symbolic equivalence), regex format check.

Each verifier is a small frozen dataclass with the reward-function signature
``(prompt, response, label, **info) -> float`` returning 1.0 or 0.0; being
plain picklable objects they run in the process pool as well as in-process.
Addressed by spec string (:func:`make_builtin` gets the part after ``builtin:``):

=============================  ==============================================================
``builtin:exact_match``        response == label after stripping, collapsing whitespace, casefold
``builtin:exact_match:strict`` response == label, byte for byte
``builtin:math``               math-verify's verdict: the response's last ``\\boxed{}`` (else the
                               answer after "answer is", else the last expression) equivalent to
                               the label under sympy; our own number/string comparison only
                               where math-verify extracts nothing
``builtin:math:REL_TOL``       the same, and numbers within relative tolerance REL_TOL also
                               count as equal, e.g. ``math:1e-4``
``builtin:format:REGEX``       1.0 when ``re.search(REGEX, response)`` matches (``re.DOTALL``;
                               anchor with ``^...$`` to check the whole response)
=============================  ==============================================================

``builtin:math`` asks math-verify (the package verl and TRL use), run in a sandbox process with a hard
time bound (:mod:`rl_rollout.rewards.math_sandbox`): fractions, decimals, percentages (``50\\%`` equals
``50`` and ``0.5``), intervals, sets, tuples, matrices, units in ``\\text{}``, degrees, ``x =`` forms and
algebra (``\\sqrt{8}`` equals ``2\\sqrt{2}``, ``(x+1)^2`` equals ``x^2+2x+1``). An answer it cannot judge in
time (``timeout_s``, default 5 s) scores 0, counted and logged (:func:`rl_rollout.rewards.math_sandbox.counts`),
and never hangs the run. Where math-verify extracts no answer from the response or the label, the earlier
comparison decides: the last ``\\boxed{}`` (else last number) compared numerically (``math.isclose``,
rel_tol 1e-6, abs_tol 1e-9), parsing integers, decimals, scientific notation, thousands commas (``1,234``),
fractions (``1/2``, ``\\frac{1}{2}``, ``\\dfrac12``), a leading ``x =``, ``$``, ``\\%`` and degree marks;
answers that are not numbers are compared as strings with spaces and ``\\left``/``\\right`` removed.
A label may itself hold a ``\\boxed{}`` or a GSM8K-style ``#### 42`` tail.
Verifiers that need a label raise ValueError when it is None (the runner counts
that as an error); :func:`needs_label` tells which specs need one, so a run
without labels is refused before it starts.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from rl_rollout.rewards.math_sandbox import Verdict, judge, warm


class Builtin(str, Enum):
    EXACT_MATCH = "exact_match"
    MATH = "math"
    FORMAT = "format"


BUILTIN_FORMS = ["exact_match", "exact_match:strict", "math", "math:REL_TOL", "format:REGEX"]


def make_builtin(name: str) -> Any:
    """Build the verifier for ``name`` (a spec without its ``builtin:`` prefix), e.g. ``"math:1e-4"``."""
    from rl_rollout.rewards.loading import (
        RewardLoadError,
    )  # lazy: import cycle (rewards.loading builds these verifiers)

    base, _, arg = name.partition(":")
    try:
        kind = Builtin(base)
    except ValueError:
        raise RewardLoadError(
            f"unknown builtin reward {name!r}; valid: {['builtin:' + f for f in BUILTIN_FORMS]}"
        ) from None
    if kind is Builtin.EXACT_MATCH:
        if arg not in ("", "strict"):
            raise RewardLoadError(f"builtin:exact_match takes no option or ':strict', got {arg!r} in {name!r}")
        return ExactMatch(normalize=arg == "")
    if kind is Builtin.MATH:
        try:
            verifier = MathAnswer(rel_tol=float(arg)) if arg else MathAnswer()
        except ValueError as e:
            raise RewardLoadError(f"builtin:math:REL_TOL needs a float >= 0 after 'math:', got {arg!r}: {e}") from None
        try:
            warm()  # the judge's sandbox starts with the spec (in each reward worker), not inside a reward timeout
        except RuntimeError as e:
            raise RewardLoadError(str(e)) from None
        return verifier
    if not arg:
        raise RewardLoadError("builtin:format needs a regex after 'format:', e.g. 'builtin:format:^<a>.*</a>$'")
    try:
        return FormatCheck(arg)
    except re.error as e:
        raise RewardLoadError(f"builtin:format: {arg!r} is not a valid regex ({e}); fix the pattern") from None


def needs_label(spec: object) -> bool:
    """Whether reward spec ``spec`` is a builtin that compares with the dataset's label (exact_match, math):
    a run without a ``label_key`` can be refused before anything loads."""
    if not isinstance(spec, str) or not spec.startswith("builtin:"):
        return False
    return spec.removeprefix("builtin:").partition(":")[0] in (Builtin.EXACT_MATCH.value, Builtin.MATH.value)


def _need_label(label: str | None, who: str) -> str:
    if label is None:
        raise ValueError(f"{who} needs a reference answer but label is None; set the dataset's label_key")
    return label


def normalize_text(text: str) -> str:
    """Strip, collapse runs of whitespace to one space, casefold."""
    return " ".join(text.split()).casefold()


@dataclass(frozen=True)
class ExactMatch:
    """1.0 when the response equals the label (after :func:`normalize_text` when ``normalize``)."""

    normalize: bool = True

    def __call__(self, prompt: str, response: str, label: str | None, **info: Any) -> float:
        label = _need_label(label, "builtin:exact_match")
        if self.normalize:
            return float(normalize_text(response) == normalize_text(label))
        return float(response == label)


@dataclass(frozen=True)
class FormatCheck:
    """1.0 when ``re.search(pattern, response, re.DOTALL)`` matches; the label is not used."""

    pattern: str
    _regex: re.Pattern = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_regex", re.compile(self.pattern, re.DOTALL))

    def __call__(self, prompt: str, response: str, label: str | None, **info: Any) -> float:
        return float(self._regex.search(response) is not None)


@dataclass(frozen=True)
class MathAnswer:
    """1.0 when math-verify finds the response's final answer equivalent to the label's (see the module doc).

    math-verify decides wherever it extracts an answer from both; our number/string comparison
    (:meth:`legacy`) only where it extracts none. ``rel_tol`` (``builtin:math:REL_TOL``): numbers within this
    relative tolerance also count as equal, where math-verify rounds to 6 decimals. ``timeout_s``: the most one
    verdict may take; past it the answer scores 0 (counted in ``math_sandbox.counts()`` and logged).
    """

    rel_tol: float | None = None
    abs_tol: float = 1e-9
    timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if not ((self.rel_tol is None or self.rel_tol >= 0) and self.abs_tol >= 0):
            raise ValueError(f"MathAnswer tolerances must be >= 0, got rel_tol={self.rel_tol}, abs_tol={self.abs_tol}")
        if not 0 < self.timeout_s < math.inf:
            raise ValueError(f"MathAnswer timeout_s must be a finite number of seconds > 0, got {self.timeout_s!r}")

    def __call__(self, prompt: str, response: str, label: str | None, **info: Any) -> float:
        reference = label_answer(_need_label(label, "builtin:math"))
        # The last complete \\boxed{} is the answer (math-verify alone would read every box, as a set).
        boxed = last_boxed(response)
        verdict = judge(reference, response if boxed is None else f"\\boxed{{{boxed}}}", self.timeout_s)
        if verdict is Verdict.EQUAL:
            return 1.0
        if verdict is Verdict.NO_PARSE:
            return self.legacy(reference, response)
        if verdict is Verdict.DIFFERENT and self.rel_tol is not None:
            return self._within_tolerance(reference, response, self.rel_tol)
        return 0.0  # different, or no verdict in time (counted and logged by the sandbox)

    def legacy(self, reference: str, response: str) -> float:
        """The comparison before math-verify: last ``\\boxed{}`` (else last number) against ``reference``
        numerically, else as text; used where math-verify extracts no answer."""
        predicted = extract_math_answer(response)
        if predicted is None:
            return 0.0
        a, b = parse_number(predicted), parse_number(reference)
        if a is not None and b is not None:
            rel_tol = 1e-6 if self.rel_tol is None else self.rel_tol
            return float(math.isclose(a, b, rel_tol=rel_tol, abs_tol=self.abs_tol))
        return float(_canonical(predicted) == _canonical(reference))

    def _within_tolerance(self, reference: str, response: str, rel_tol: float) -> float:
        predicted = extract_math_answer(response)
        a = None if predicted is None else parse_number(predicted)
        b = parse_number(reference)
        return float(a is not None and b is not None and math.isclose(a, b, rel_tol=rel_tol, abs_tol=self.abs_tol))


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced; None when there is none."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0 or text[start:i].strip() not in ("\\boxed", "\\fbox"):
        return None
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j].strip()
    return None  # unbalanced: the response was cut off inside the box


_INT = r"(?:\d{1,3}(?:,\d{3})+|\d+)"
_NUM = rf"{_INT}(?:\.\d+)?"
# A sign counts only when it does not follow a word character (so "3-4" ends in "4", not "-4").
_LAST_NUMBER_RE = re.compile(
    rf"(?<![\w.])[-+]?(?:\\[dt]?frac\{{[^{{}}]+\}}\{{[^{{}}]+\}}|{_NUM}(?:\s*/\s*{_NUM}|[eE][-+]?\d+)?)"
)


def extract_math_answer(text: str) -> str | None:
    """The last ``\\boxed{}`` content, else the last number (``1,234``, ``-2.5``, ``1/2``, ``\\frac{1}{2}``)."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    numbers_found = _LAST_NUMBER_RE.findall(text)
    return numbers_found[-1] if numbers_found else None


def label_answer(label: str) -> str:
    """The reference answer in a label: its last ``\\boxed{}``, the text after ``####`` (GSM8K), or the label."""
    boxed = last_boxed(label)
    if boxed is not None:
        return boxed
    if "####" in label:
        return label.rsplit("####", 1)[1].strip()
    return label.strip()


_PLAIN_RE = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")
_COMMA_INT_RE = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d*)?")
_FRAC_RE = re.compile(r"([+-]?)\\frac\{([^{}]+)\}\{([^{}]+)\}")
_FRAC_SHORT_RE = re.compile(r"([+-]?)\\frac(\d)(\d)")
_SLASH_RE = re.compile(r"([+-]?)([\d.,]+)/([\d.,]+)")


def _clean(text: str) -> str:
    s = re.sub(r"\\(?:text|mathrm|mbox)\{([^{}]*)\}", r"\1", text)
    s = s.replace("\\left", "").replace("\\right", "").replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    for junk in ("$", "\\!", "\\,", "\\;", "\\ ", "^{\\circ}", "^\\circ", "\\%", "%", "°"):
        s = s.replace(junk, "")
    s = "".join(s.split())
    if "=" in s:
        s = s.rsplit("=", 1)[1]
    return s.rstrip(".")


def _plain_number(s: str) -> float | None:
    if _COMMA_INT_RE.fullmatch(s):
        s = s.replace(",", "")
    return float(s) if _PLAIN_RE.fullmatch(s) else None


def parse_number(text: str) -> float | None:
    """``text`` as a number (see the module docstring for the forms), or None when it is not one."""
    s = _clean(text)
    m = _FRAC_RE.fullmatch(s) or _FRAC_SHORT_RE.fullmatch(s) or _SLASH_RE.fullmatch(s)
    if m is None:
        return _plain_number(s)
    sign_text, num_text, den_text = m.groups()
    num, den = _plain_number(num_text), _plain_number(den_text)
    if num is None or den is None or den == 0:
        return None
    return (-num if sign_text == "-" else num) / den


def _canonical(text: str) -> str:
    return _clean(text).casefold()
