"""``python -m rl_cli.train_kto``: the same as ``rl kto`` (OpenRLHF's ``openrlhf.cli.train_kto`` habit)."""

from rl_cli.train import module_main

if __name__ == "__main__":
    module_main("kto")
