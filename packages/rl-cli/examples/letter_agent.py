"""A letter-repeating agent written only against the ``openai`` package: the task a tiny model learns in minutes.

The task is ``rl demo``'s (``Repeat the letter X: ``, reward = the share of the reply that is ``X``), played as a
conversation of the agent's own: it asks the model, then says ``more`` and asks again, and scores both replies
itself. It knows nothing of the trainer: it reads its row (``prompt``, ``label``, the row's other keys) as one JSON
object on stdin, talks to whatever OpenAI-compatible endpoint ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY`` /
``OPENAI_MODEL`` name, and prints ``{"reward": x}`` as its last line. By hand, against any endpoint:

    echo '{"prompt": "Repeat the letter a: ", "label": "a"}' | python packages/rl-cli/examples/letter_agent.py

``AGENT_MAX_TOKENS`` bounds each reply (default 8, the demo's ``--max_new_tokens``); ``AGENT_TURNS`` the calls
(default 2). ``agent(row, endpoint)`` is the same episode as a Python entry point
(``--agent_cmd path/letter_agent.py:agent``: no process per episode).
"""

import json
import os
import sys

from openai import OpenAI


def play(client: OpenAI, model: str, row: dict) -> dict:
    """One episode: ``AGENT_TURNS`` replies, each scored as the share of its ``AGENT_MAX_TOKENS`` slots holding
    the row's letter (as ``rl demo`` scores), the reward their mean (1.0: every slot of every reply)."""
    max_tokens = int(os.environ.get("AGENT_MAX_TOKENS", "8"))
    turns = int(os.environ.get("AGENT_TURNS", "2"))
    letter = str(row["label"])
    messages = [{"role": "user", "content": row["prompt"]}]
    scores = []
    for turn in range(turns):
        reply = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens)
        text = reply.choices[0].message.content or ""
        scores.append(min(text.count(letter), max_tokens) / max_tokens)
        messages.append({"role": "assistant", "content": text})
        if turn + 1 < turns:
            messages.append({"role": "user", "content": "more"})
    return {"reward": sum(scores) / len(scores)}


def agent(row: dict, endpoint) -> dict:
    """The entry-point form: ``endpoint`` has ``base_url``, ``api_key`` and ``model``."""
    client = OpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key)
    return play(client, endpoint.model, row)


def main() -> None:
    row = json.loads(sys.stdin.read())
    client = OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
    print(json.dumps(play(client, os.environ.get("OPENAI_MODEL", "policy"), row)))


if __name__ == "__main__":
    main()
