"""A trainer process for the weight transport tests: ``python transport_trainer.py MODEL PORT WORLD_SIZE``.

Rank 0 of the weight group (:class:`rl_rollout.transport.CollectiveSender`).
Each stdin line is a JSON command ``{"seed", "version", "bucket_bytes",
"corrupt"}``: it sends ``peaked_weights(model, seed=seed)`` (the test computes
the same state locally) and answers one JSON line on stdout, ``{"ok": true,
"stats": {...}}`` or ``{"ok": false, "error": "..."}``. EOF ends it. Run as a
script so the test modules (imported with ``--import-mode=importlib``) need not
be importable here.
"""

import json
import logging
import os
import socket
import subprocess
import sys


class TrainerProcess:
    """Test-side handle: starts this script as rank 0 and sends it commands."""

    def __init__(self, model_path, world_size: int = 2) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), str(model_path), str(self.port), str(world_size)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )

    def send(self, seed: int, version: int, bucket_bytes: int, corrupt: int | None = None) -> None:
        """Ask for one sync; the engine must then receive, and ``reply()`` returns the sender's outcome."""
        cmd = {"seed": seed, "version": version, "bucket_bytes": bucket_bytes, "corrupt": corrupt}
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def reply(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"trainer process ended (exit code {self.proc.wait()}); see its stderr")
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def main() -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from rl_rollout.testing import peaked_weights
    from rl_rollout.transport import CollectiveSender

    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    model_path, port, world_size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    sender = CollectiveSender("127.0.0.1", port, world_size, backend="gloo", timeout_s=120)
    for line in sys.stdin:
        cmd = json.loads(line)
        state = peaked_weights(model, seed=cmd["seed"])
        try:
            stats = sender.send(
                state.items(), cmd["version"], bucket_bytes=cmd["bucket_bytes"],
                corrupt_bucket_for_test=cmd.get("corrupt"),
            )
            reply = {"ok": True, "stats": stats.as_dict()}
        except Exception as e:
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        print(json.dumps(reply), flush=True)
    sender.close()


if __name__ == "__main__":
    main()
