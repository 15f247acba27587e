"""``python -m rl_cli.train_rm``: the same as ``rl rm`` (OpenRLHF's ``openrlhf.cli.train_rm`` habit)."""

from rl_cli.train import module_main

if __name__ == "__main__":
    module_main("rm")
