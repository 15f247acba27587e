"""``python -m rl_cli.train_ppo_ray``: OpenRLHF's module habit for ``rl ppo-ray``."""

import sys

from rl_cli.ppo_ray import run_ray

if __name__ == "__main__":
    sys.exit(run_ray())
