"""A calculator agent written only against the ``openai`` package, trained with ``rl ppo --agent_cmd``.

It knows nothing of the trainer: it reads its task (one JSON object: ``prompt``, ``label`` and the row's other
keys) from stdin, talks to whatever OpenAI-compatible endpoint ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY`` /
``OPENAI_MODEL`` name, runs its own loop (an answer, then a check turn where it may correct itself), scores
itself and prints ``{"reward": x}`` as its last line. Run by hand against any endpoint:

    echo '{"prompt": "What is 3+4?", "label": "7"}' | python packages/rl-cli/examples/calculator_agent.py

``AGENT_MAX_TOKENS`` bounds each answer (default 16); ``AGENT_TURNS`` the calls (default 2).
"""

import json
import os
import re
import sys

from openai import OpenAI


def main() -> None:
    row = json.loads(sys.stdin.read())
    client = OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
    model = os.environ.get("OPENAI_MODEL", "policy")
    max_tokens = int(os.environ.get("AGENT_MAX_TOKENS", "16"))
    turns = int(os.environ.get("AGENT_TURNS", "2"))
    messages = [
        {"role": "system", "content": "You are a calculator. Answer with one number."},
        {"role": "user", "content": row["prompt"]},
    ]
    answer = ""
    for turn in range(turns):
        reply = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens)
        answer = reply.choices[0].message.content or ""
        messages.append({"role": "assistant", "content": answer})
        if turn + 1 < turns:
            messages.append({"role": "user", "content": "Check it. Reply with the final number only."})
    numbers = re.findall(r"-?\d+(?:\.\d+)?", answer)
    label = str(row.get("label", ""))
    # 1 for the right final number, a little for answering with a number at all: a signal a small model can climb
    reward = 1.0 if numbers and numbers[-1] == label else 0.1 if numbers else 0.0
    print(json.dumps({"reward": reward, "answer": answer}))


if __name__ == "__main__":
    main()
