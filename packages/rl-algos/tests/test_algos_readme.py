"""The README's GRPO example runs as written and produces a finite loss with gradients."""

import re
from pathlib import Path


def test_readme_grpo_example_runs():
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "README.md has no python example"
    ns: dict = {}
    exec(compile(blocks[0], "README.md", "exec"), ns)
    assert ns["out"].loss.isfinite()
    assert ns["logits"].grad is not None and ns["logits"].grad.abs().sum() > 0
    assert len(blocks[0].strip().splitlines()) <= 14
