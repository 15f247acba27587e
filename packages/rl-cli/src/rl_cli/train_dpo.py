"""``python -m rl_cli.train_dpo``: the same as ``rl dpo`` (OpenRLHF's ``openrlhf.cli.train_dpo`` habit)."""

from rl_cli.train import module_main

if __name__ == "__main__":
    module_main("dpo")
