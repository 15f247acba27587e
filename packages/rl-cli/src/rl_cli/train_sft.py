"""``python -m rl_cli.train_sft``: the same as ``rl sft`` (OpenRLHF's ``openrlhf.cli.train_sft`` habit)."""

from rl_cli.train import module_main

if __name__ == "__main__":
    module_main("sft")
