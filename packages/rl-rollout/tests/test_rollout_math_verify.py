"""builtin:math on math-verify (issue 39 item 2): a table of answer pairs, each scored by our reward and checked
against both the value stated here and what math-verify itself decides, and the sandbox's time bound."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from rl_rollout.rewards import MathAnswer, load_reward_fn, math_sandbox
from rl_rollout.rewards.verifiers import label_answer, last_boxed

math_verify = pytest.importorskip("math_verify")

# (completion, gold label, expected reward). Expected is what a grader should say; every row also equals
# math-verify's own verdict (computed below in this process, independently of our sandbox), except the
# rows where math-verify extracts nothing (marked NONE): there our earlier comparison decides.
NONE = "math-verify extracts nothing"
TABLE = [
    # algebra: the pairs string/number comparison missed (0.0 before math-verify, 1.0 now)
    ("\\boxed{\\sqrt{4}}", "2", 1.0),
    ("so \\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0),
    ("\\boxed{x^2+2x+1}", "(x+1)^2", 1.0),
    ("\\boxed{\\sqrt{12}}", "2\\sqrt{3}", 1.0),
    ("\\boxed{x^2-1}", "(x-1)(x+1)", 1.0),
    ("\\boxed{\\sin^2 x + \\cos^2 x}", "1", 1.0),
    ("\\boxed{\\log_2 8}", "3", 1.0),
    ("\\boxed{\\binom{5}{2}}", "10", 1.0),
    ("\\boxed{5!}", "120", 1.0),
    ("\\boxed{\\sqrt{2}/2}", "\\frac{1}{\\sqrt{2}}", 1.0),
    ("\\boxed{\\pi/2}", "\\frac{\\pi}{2}", 1.0),
    ("\\boxed{2+3i}", "3i+2", 1.0),
    ("\\boxed{\\sqrt{8}}", "3", 0.0),
    ("\\boxed{(x+1)^2}", "x^2+2x+2", 0.0),
    ("\\boxed{x+2}", "x+1", 0.0),
    # fractions and decimals
    ("The answer is \\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("so 1/2", "\\frac12", 1.0),
    ("\\boxed{\\dfrac{3}{4}}", "3/4", 1.0),
    ("\\boxed{0.75}", "\\frac{3}{4}", 1.0),
    ("\\boxed{\\frac{6}{8}}", "\\frac34", 1.0),
    ("\\boxed{-\\frac{1}{2}}", "-0.5", 1.0),
    ("\\boxed{0.333333}", "\\frac13", 1.0),
    ("\\boxed{\\frac{1}{3}}", "0.33", 0.0),
    ("\\boxed{3.14}", "3.1416", 0.0),
    ("\\boxed{2.50}", "2.5", 1.0),
    ("\\boxed{10^{-3}}", "0.001", 1.0),
    ("The total is 1,234,567 dollars.", "1234567", 1.0),
    ("\\boxed{1,234}", "#### 1,234", 1.0),
    ("\\boxed{3}", "4", 0.0),
    ("\\boxed{-3}", "3", 0.0),
    # percentages (math-verify accepts the percent and the fraction)
    ("\\boxed{50\\%}", "50", 1.0),
    ("\\boxed{50\\%}", "0.5", 1.0),
    ("\\boxed{25\\%}", "\\frac14", 1.0),
    ("\\boxed{0.1}", "10\\%", 1.0),
    # intervals
    ("\\boxed{(1,2]}", "(1,2]", 1.0),
    ("\\boxed{[1,2)}", "(1,2]", 0.0),
    ("\\boxed{(-\\infty, 3)}", "x<3", 1.0),
    ("\\boxed{x \\in [2, 5]}", "[2,5]", 1.0),
    ("\\boxed{\\left(3, 4\\right)}", "(3,4)", 1.0),
    # sets and lists
    ("\\boxed{\\{1,2,3\\}}", "\\{3,2,1\\}", 1.0),
    ("\\boxed{\\{1,2\\}}", "\\{1,2,3\\}", 0.0),
    ("\\boxed{1,2,3}", "3,2,1", 1.0),
    ("\\boxed{x=2 \\text{ or } x=3}", "2,3", 1.0),
    # units and degrees
    ("\\boxed{5\\text{ cm}}", "5", 1.0),
    ("\\boxed{12 \\text{ apples}}", "12", 1.0),
    ("\\boxed{5 \\mathrm{kg}}", "5", 1.0),
    ("\\boxed{90^\\circ}", "90", 1.0),
    ("\\boxed{\\$12.50}", "12.5", 1.0),
    # x= forms
    ("\\boxed{x=3}", "3", 1.0),
    ("so $x = 3$", "3", 1.0),
    ("\\boxed{y=2x+1}", "2x+1", 1.0),
    ("\\boxed{x=-1}", "x=-1", 1.0),
    ("\\boxed{x = 4}", "y = 4", 0.0),
    # extraction: the last box wins, then an anchor, then the last expression
    ("I think it's 7. Wait no, \\boxed{8}", "8", 1.0),
    ("\\boxed{8} ... actually 7", "8", 1.0),
    ("first \\boxed{3} then \\boxed{-\\frac{3}{4}}", "-0.75", 1.0),
    ("\\boxed{42} and later 41", "41", 0.0),
    ("answer: 42", "42", 1.0),
    ("\\boxed{\\text{Monday}}", "Monday", 1.0),
    ("\\boxed{B}", "A", 0.0),
    ("\\boxed{\\begin{pmatrix}1\\\\2\\end{pmatrix}}", "\\begin{pmatrix}1\\\\2\\end{pmatrix}", 1.0),
    # math-verify extracts nothing: our earlier comparison decides
    ("no answer here", "5", 0.0, NONE),
    ("\\boxed{12", "12", 1.0, NONE),  # cut off inside the box: the last number, 12
    ("\\boxed{12", "2", 0.0, NONE),
]


def _math_verify_decides(completion: str, gold: str) -> bool | None:
    """math-verify's verdict, called as verl and TRL call it: the reference boxed, the completion's last box."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    boxed = last_boxed(completion)
    answer = completion if boxed is None else "\\boxed{" + boxed + "}"
    g = parse("\\boxed{" + label_answer(gold) + "}", [LatexExtractionConfig(), ExprExtractionConfig()])
    a = parse(answer, [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()])
    return verify(g, a) if g and a else None


def test_table_is_large_and_covers_the_forms():
    assert len(TABLE) >= 40
    assert sum(r[2] == 0.0 for r in TABLE) >= 10  # wrong answers too


@pytest.mark.parametrize("row", TABLE, ids=[f"{i}:{r[0][:30]}|{r[1][:15]}" for i, r in enumerate(TABLE)])
def test_math_reward_equals_math_verify_and_expected(row):
    completion, gold, expected = row[:3]
    reward = MathAnswer()("p", completion, gold)
    decided = _math_verify_decides(completion, gold)
    assert reward == expected, f"reward {reward}, expected {expected}"
    if len(row) > 3:
        assert decided is None, f"math-verify now decides this row ({decided}): move it up the table"
    else:
        assert decided is not None and float(decided) == reward, f"math-verify decides {decided}, we {reward}"


def test_rel_tol_spec_adds_numeric_tolerance():
    assert load_reward_fn("builtin:math:1e-2")("p", "\\boxed{3.14}", "3.1416") == 1.0
    assert load_reward_fn("builtin:math")("p", "\\boxed{3.14}", "3.1416") == 0.0


def test_changed_by_math_verify():
    # math-verify reads 1e3 as 1*e*3 (Euler's e) and 'x = 1,000' as a list: our earlier comparison said 1.0.
    assert MathAnswer()("p", "1e3 grams", "1000") == 0.0 == float(_math_verify_decides("1e3 grams", "1000"))
    assert MathAnswer()("p", "\\boxed{x = 1,000}", "1000") == 0.0
    assert MathAnswer()("p", "\\boxed{x = 1000}", "1000") == 1.0


def test_adversarial_answer_is_bounded_and_scores_zero():
    m = MathAnswer(timeout_s=5.0)
    m("p", "\\boxed{1}", "1")  # a sandbox started and idle: the bound below is the verdict's alone
    for completion, gold in [("\\boxed{9^{9^{9^{9}}}}", "1"), ("\\boxed{10^{10^{10}}}", "0")]:
        start = time.monotonic()
        assert m("p", completion, gold) == 0.0
        assert time.monotonic() - start < 5.0 + 2.0


def test_timeout_kills_the_sandbox_counts_and_logs(caplog):
    m = MathAnswer(timeout_s=0.2)  # below math-verify's own 1 s alarm: only the kill can stop it
    m("p", "\\boxed{1}", "1")
    before = math_sandbox.counts()["timeouts"]
    start = time.monotonic()
    with caplog.at_level("WARNING", logger="rl_rollout.rewards.math_sandbox"):
        assert m("p", "\\boxed{9^{9^{9^{9}}}}", "1") == 0.0
    assert time.monotonic() - start < 2.0
    assert math_sandbox.counts()["timeouts"] == before + 1
    assert "no verdict within 0.2 s" in caplog.text
    assert MathAnswer()("p", "\\boxed{\\sqrt{4}}", "2") == 1.0  # the next call gets a fresh sandbox


def test_off_the_main_thread_and_a_dead_idle_sandbox():
    out: list[float] = []
    t = threading.Thread(target=lambda: out.append(MathAnswer()("p", "\\boxed{\\sqrt{8}}", "2\\sqrt{2}")))
    t.start()
    t.join(60)
    assert out == [1.0]
    for box in list(math_sandbox._idle):  # an idle sandbox killed from outside (an OOM killer, say)
        box.proc.kill()
        box.proc.wait()
    assert MathAnswer()("p", "\\boxed{(x+1)^2}", "x^2+2x+1") == 1.0


def test_import_rl_rollout_loads_neither_sympy_nor_math_verify():
    code = (
        "import sys, rl_rollout, rl_rollout.rewards; from rl_rollout.rewards import load_reward_fn; "
        "load_reward_fn('builtin:math'); "
        "bad = [m for m in ('sympy', 'math_verify', 'latex2sympy2_extended') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
