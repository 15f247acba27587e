"""``python -m rl_cli.train_ppo``: OpenRLHF's module habit for ``rl ppo``."""

import sys

from rl_cli.ppo import run_local

if __name__ == "__main__":
    sys.exit(run_local())
