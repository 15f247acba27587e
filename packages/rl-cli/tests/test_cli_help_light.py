"""``rl COMMAND --help`` imports no torch, DeepSpeed or transformers (issue 39 item 3: ``rl ppo --help`` under 3 s on
a 2-core machine, where importing torch alone takes about 2 s). The flags come from config classes in modules that
import none of them; what loads models and runs the loop is imported where a command runs. A module-level import
of a heavy module on the help path fails here, naming the command."""

from __future__ import annotations

import json
import os
import subprocess
import sys

HEAVY = ("torch", "deepspeed", "transformers", "vllm", "ray")
COMMANDS = ("ppo", "ppo-ray", "sft", "rm", "dpo", "kto", "demo")

CHILD = """
import contextlib, io, json, sys
from rl_cli.main import main
heavy, out = {heavy!r}, {{}}
for command in {commands!r}:
    with contextlib.redirect_stdout(io.StringIO()) as text:
        try:
            main([command, "--help"])
        except SystemExit as e:
            assert e.code in (0, None), (command, e.code)
    assert "--help" in text.getvalue(), command  # the help was printed
    out[command] = sorted(m for m in heavy if m in sys.modules)
print(json.dumps(out))
"""


def test_help_of_every_training_command_imports_no_heavy_library():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    code = CHILD.format(heavy=HEAVY, commands=COMMANDS)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    imported = json.loads(proc.stdout.strip().splitlines()[-1])
    assert imported == {c: [] for c in COMMANDS}, imported  # a command's list: what its --help imported first
