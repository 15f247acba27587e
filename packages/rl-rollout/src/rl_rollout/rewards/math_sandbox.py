"""``builtin:math``'s judge: math-verify's answer extraction and symbolic equivalence, in a sandbox process.

:func:`judge` asks math-verify (the ``math-verify`` package verl and TRL use: LaTeX and plain expressions parsed
into sympy) whether a response's final answer equals a reference answer. The work runs in a separate Python
process (a *sandbox*), never in the caller's, because sympy can run for hours on adversarial input
(``9^{9^{9^{9}}}`` evaluates a power tower) and math-verify's own time bound, ``signal.alarm``, neither works
off the main thread (where ``RewardRunner`` calls rewards by default, ``workers=0``) nor interrupts a long C
computation such as a big integer power, which also holds the GIL, stalling every thread of the trainer.
So a call is bounded three ways:

- in the sandbox, math-verify's ``parsing_timeout`` / ``timeout_seconds`` (signals work there: its main thread
  does the work) stop slow pure-Python sympy work early and cheaply;
- the caller waits at most ``timeout_s`` for the answer, then kills the sandbox (``SIGKILL``): the call
  returns :attr:`Verdict.TIMEOUT` and the next call starts a fresh sandbox (about a second: Python, sympy,
  math-verify);
- the sandbox kills itself after ``2 * timeout_s + 1`` CPU seconds on one request (``SIGPROF``'s default
  action) and caps its address space at :data:`MEMORY_LIMIT_BYTES`, so it cannot outlive a caller that died
  mid-request or fill the machine's memory.

Sandboxes are reused (one request at a time each, a pool per process, started on demand: threads calling at
once get one each), are plain ``subprocess`` children (they work from daemonic worker processes, Ray actors
and threads alike) and exit when their stdin closes. Timeouts and sandbox deaths are counted
(:func:`counts`) and logged (the first 10 of each, then every 100th). math-verify and sympy are imported only
in the sandbox, never in the caller's process.
"""

from __future__ import annotations

import atexit
import enum
import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from typing import IO, Any

log = logging.getLogger(__name__)

MEMORY_LIMIT_BYTES = 4 << 30  # the sandbox's address space: sympy on honest answers needs a few hundred MB
STARTUP_TIMEOUT_S = 120.0  # importing sympy and math-verify: ~1 s idle, more on a loaded machine
MAX_IDLE = 16  # sandboxes kept between calls; more are closed when returned


class Verdict(str, enum.Enum):
    EQUAL = "equal"  # math-verify parsed both answers and found them equivalent
    DIFFERENT = "different"  # parsed both, not equivalent
    NO_PARSE = "no_parse"  # math-verify extracted nothing from the response or the reference
    TIMEOUT = "timeout"  # no verdict within timeout_s; the sandbox was killed
    CRASH = "crash"  # the sandbox died on this request (out of memory, its CPU bound, a crash)


# --- the sandbox's side -------------------------------------------------------------------------------------


def decide(reference: str, response: str, inner_timeout_s: int | None = None) -> Verdict:
    """math-verify's verdict on ``response`` against ``reference``, in this process (the sandbox's main thread:
    with ``inner_timeout_s`` math-verify sets ``signal.alarm``, which only works there; None: no bound)."""
    # lazy: sympy and math-verify load in the sandbox only (seconds of import, and sympy must not run in the caller)
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    t = inner_timeout_s if inner_timeout_s else None
    # The reference is a bare answer (the label's \boxed{} content or GSM8K tail): boxed, so all of it is read.
    gold = parse(
        "\\boxed{" + reference + "}",
        [LatexExtractionConfig(), ExprExtractionConfig()],
        parsing_timeout=t,  # type: ignore[arg-type]  # math-verify annotates int but accepts None (no alarm)
    )
    # The response: its last \boxed{} first, else a LaTeX or plain expression after an "answer is"-style anchor,
    # else the last one in the text.
    answer = parse(
        response,
        [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()],
        parsing_timeout=t,  # type: ignore[arg-type]
    )
    if not gold or not answer:
        return Verdict.NO_PARSE
    return Verdict.EQUAL if verify(gold, answer, timeout_seconds=t) else Verdict.DIFFERENT


def _limit_self() -> None:
    try:
        import resource  # lazy: POSIX only; the sandbox runs without a memory cap where it is missing

        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT_BYTES, MEMORY_LIMIT_BYTES))
    except (ImportError, ValueError, OSError):
        pass
    for name in ("math_verify", "latex2sympy2_extended"):  # their timeout warnings print the whole answer
        logging.getLogger(name).setLevel(logging.CRITICAL)


def serve(stdin: IO[str], stdout: IO[str]) -> None:
    """The sandbox's loop: one JSON request per line (``[reference, response, timeout_s]``), one reply per
    line (``{"v": verdict}`` or ``{"error": text}``); ends when stdin closes."""
    _limit_self()
    decide("1", "\\boxed{1}")  # import and warm everything before saying ready
    stdout.write('{"ready": true}\n')
    stdout.flush()
    for line in stdin:
        try:
            reference, response, timeout_s = json.loads(line)
            # A CPU bound the caller's death cannot lift: SIGPROF's default action ends this process.
            signal.setitimer(signal.ITIMER_PROF, 2 * float(timeout_s) + 1)
            try:
                verdict = decide(reference, response, max(1, int(float(timeout_s) / 4)))
            finally:
                signal.setitimer(signal.ITIMER_PROF, 0)
            reply: dict[str, Any] = {"v": verdict.value}
        except Exception as e:  # math-verify catches its own; anything else is reported, the sandbox lives on
            reply = {"error": f"{type(e).__name__}: {e}"[:500]}
        stdout.write(json.dumps(reply) + "\n")
        stdout.flush()


# --- the caller's side --------------------------------------------------------------------------------------


class _Sandbox:
    def __init__(self) -> None:
        env = dict(os.environ)
        # The sandbox imports math_verify the way this process would: same interpreter, same path.
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        self.proc = subprocess.Popen(
            [sys.executable, "-u", os.path.abspath(__file__), "serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            close_fds=True,
        )
        ready = self._reply(STARTUP_TIMEOUT_S)
        if ready != {"ready": True}:
            self.kill()
            raise RuntimeError(
                f"builtin:math: the math-verify sandbox ({sys.executable}) did not start within "
                f"{STARTUP_TIMEOUT_S:.0f} s (reply {ready!r}); is math-verify installed "
                f"(pip install 'math-verify[antlr4_13_2]')? Its stderr is above"
            )

    def _reply(self, timeout_s: float) -> dict | None:
        """The next line from the sandbox as JSON; None on timeout or when it died."""
        out = self.proc.stdout
        assert out is not None
        ready, _, _ = select.select([out], [], [], max(0.0, timeout_s))
        if not ready:
            return None
        line = out.readline()  # replies are one short line, written at once
        return json.loads(line) if line else None

    def ask(self, reference: str, response: str, timeout_s: float) -> dict | None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps([reference, response, timeout_s]) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            return None
        return self._reply(timeout_s)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                try:
                    f.close()
                except OSError:
                    pass


_lock = threading.Lock()
_idle: list[_Sandbox] = []
_counts = {"checks": 0, "timeouts": 0, "crashes": 0}


def _forget_after_fork() -> None:  # a forked child must not share (or kill) its parent's sandboxes
    global _lock
    _lock = threading.Lock()
    _idle.clear()
    for k in _counts:
        _counts[k] = 0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)


@atexit.register
def close_all() -> None:
    """Stop this process's idle sandboxes (at exit; a later call starts new ones)."""
    with _lock:
        boxes = list(_idle)
        _idle.clear()
    for box in boxes:
        box.kill()


def counts() -> dict[str, int]:
    """This process's judged calls (``checks``), and of them ``timeouts`` and sandbox deaths (``crashes``)."""
    with _lock:
        return dict(_counts)


def _count(kind: str, message: str) -> None:
    with _lock:
        _counts[kind] += 1
        n = _counts[kind]
    if n <= 10 or n % 100 == 0:
        log.warning("builtin:math: %s (%d so far in this process; scored 0)", message, n)


def warm() -> None:
    """Start a sandbox now if none is idle, so the first verdict does not pay its start (about a second, more on
    a loaded machine) inside a reward timeout; a missing math-verify fails here, when the spec loads."""
    with _lock:
        if _idle:
            return
    box = _Sandbox()
    with _lock:
        _idle.append(box)


def judge(reference: str, response: str, timeout_s: float) -> Verdict:
    """math-verify's verdict on ``response`` against ``reference``, computed in a sandbox within ``timeout_s``
    (plus a sandbox's start, at most :data:`STARTUP_TIMEOUT_S`, when none is idle)."""
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
    with _lock:
        _counts["checks"] += 1
        box = _idle.pop() if _idle else None
    if box is not None and box.proc.poll() is not None:  # died while idle (killed from outside): not this answer's
        box.kill()
        box = None
    if box is None:
        box = _Sandbox()
    start = time.monotonic()
    reply = box.ask(reference, response, timeout_s)
    if reply is None or "v" not in reply:
        died = box.proc.poll() is not None
        box.kill()
        if reply is not None:  # an error the sandbox reported (it lives, but start clean)
            raise RuntimeError(f"builtin:math: math-verify failed: {reply.get('error')}")
        if died:
            _count("crashes", f"the math-verify sandbox died judging an answer (exit {box.proc.returncode})")
            return Verdict.CRASH
        _count(
            "timeouts",
            f"math-verify gave no verdict within {timeout_s} s (stopped after {time.monotonic() - start:.1f} s)",
        )
        return Verdict.TIMEOUT
    with _lock:
        if len(_idle) < MAX_IDLE:
            _idle.append(box)
            box = None
    if box is not None:
        box.kill()
    return Verdict(reply["v"])


if __name__ == "__main__" and sys.argv[1:] == ["serve"]:
    # Run as a file: this folder is sys.path[0]; drop it so its modules cannot shadow a library's.
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    serve(sys.stdin, sys.stdout)
