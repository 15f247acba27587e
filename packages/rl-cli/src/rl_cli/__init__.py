"""rl_cli: the thin ``rl`` command over rl-algos, rl-rollout, rl-placement and rl-core."""

__version__ = "0.25.1"
