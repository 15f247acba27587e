"""Docs, help, errors and CHANGELOGs name only flags that exist.

Every ``--flag`` written in the READMEs, docs/, the CHANGELOGs and the packages' source
(help text, error messages, docstrings) must be accepted by one of the ``rl`` commands'
parsers, or by the script named on the same line (benchmarks, examples: their own
``add_argument`` calls), or belong to an outside tool named on that line (uv, ray,
torchrun, deepspeed). A doc that tells users to pass a flag the parser rejects fails here.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rl_cli import demo, openrlhf, ppo, serve_rm, train
from rl_cli import eval as rl_eval
from rl_cli.config import build_parser

ROOT = Path(__file__).resolve().parents[3]
FLAG = re.compile(r"(?<![\w-])--([a-z][a-z0-9_.]*[a-z0-9])(\.\*|_\*)?")
# where refusals are written (the tables) and explained (the module that installs them)
OPENRLHF_TABLES = {ROOT / "packages" / "rl-cli" / "src" / "rl_cli" / name for name in (
    "openrlhf_tables.py", "openrlhf_refused.py", "openrlhf.py")}
ADD_ARGUMENT = re.compile(r"add_argument\(\s*\"(--[\w.-]+)\"")
# outside tools' own flags, allowed only on a line that names the tool
TOOLS = {
    "uv ": {"--exact", "--locked", "--package", "--extra", "--find-links", "--no-deps", "--group"},
    "ray ": {"--head", "--port", "--num", "--address", "--working"},
    "torchrun": {"--nproc_per_node", "--nnodes", "--master_port", "--master_addr", "--node_rank"},
    "deepspeed ": {"--num_gpus", "--module", "--include", "--hostfile"},
    "pip ": {"--find-links", "--no-deps", "--no-build-isolation", "--no"},  # FLAG reads --no-build-isolation as --no
    "ds_to_universal": {"--input_folder", "--output_folder", "--inject_missing_state"},  # DeepSpeed's converter
}


def _parsers():
    for name, ray in (("ppo", False), ("ppo-ray", True)):
        yield build_parser(f"rl {name}", "", ppo._groups(ray))[0]
    for name, cmd in train.COMMANDS.items():
        yield build_parser(f"rl {name}", "", train._groups(cmd))[0]
    yield build_parser("rl serve-rm", "", serve_rm._groups())[0]
    yield build_parser("rl eval", "", rl_eval._groups())[0]


def rl_flags() -> set[str]:
    """Flags some command accepts (an OpenRLHF name that every command refuses is not among them)."""
    known = {"--help", "--version", "--config", "--print_config"}
    for parser in _parsers():
        known |= {n for a in parser._actions if not isinstance(a, openrlhf._Refused) for n in a.option_strings}
    for action in demo.arg_parser()._actions:
        known |= set(action.option_strings)
    return known


def refused_flags() -> set[str]:
    """OpenRLHF names the parsers refuse with a reason (rl_cli.openrlhf): named only in docs/openrlhf.md
    and on lines that say they are refused."""
    return {n for parser in _parsers() for a in parser._actions if isinstance(a, openrlhf._Refused)
            for n in a.option_strings}


def documents() -> list[Path]:
    out = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for pkg in sorted((ROOT / "packages").iterdir()):
        out += [pkg / "README.md", pkg / "CHANGELOG.md", *sorted((pkg / "src").rglob("*.py"))]
    return [p for p in out if p.is_file()]


def script_flags(line: str, here: Path) -> set[str]:
    """Flags defined by the scripts named on the line, and by the file the line is in."""
    out = set()
    paths = [ROOT / m for m in re.findall(r"[\w./-]+\.py", line)] + [here]
    for p in paths:
        if p.is_file() and p.suffix == ".py":
            out |= set(ADD_ARGUMENT.findall(p.read_text()))
    return out


def unknown_flags(paths: list[Path]) -> list[str]:
    known, refused = rl_flags(), refused_flags()
    bad = []
    for path in paths:
        for i, line in enumerate(path.read_text().splitlines(), 1):
            allow_refused = path.name == "openrlhf.md" or path in OPENRLHF_TABLES or "refuse" in line.lower()
            for m in FLAG.finditer(line):
                flag, wildcard = "--" + m.group(1), m.group(2)
                if wildcard:
                    prefix = flag + wildcard[0]
                    if any(k.startswith(prefix) for k in known):
                        continue
                if flag in known or flag in script_flags(line, path) or (allow_refused and flag in refused):
                    continue
                negated = re.match(r"-([a-z][a-z0-9_.]*[a-z0-9])", line[m.end():]) if flag == "--no" else None
                if negated and "--" + negated.group(1) in script_flags(line, path):  # argparse's --no-X of a script
                    continue
                if any(tool in line and flag in flags for tool, flags in TOOLS.items()):
                    continue
                bad.append(f"{path.relative_to(ROOT)}:{i}: {flag}")
    return bad


def test_every_documented_flag_is_accepted_by_a_parser():
    bad = unknown_flags(documents())
    assert not bad, "flags named in docs/help/errors that no parser accepts:\n" + "\n".join(bad)


def test_the_scan_reports_a_flag_that_does_not_exist():
    """The check can fail: a doc naming an unknown flag is reported with its place."""
    probe = ROOT / "docs" / "_flag_scan_probe.md"
    probe.write_text("run `rl ppo --vllm_is_correction tis`, `rl ppo --is_correction tis`, `--model.*`\n"
                     "uv sync --locked is a uv flag\nbut --locked alone is not ours\n"
                     "pass --ds_tensor_parallel_size 2 for big models\n--ds_tensor_parallel_size is refused (not built)\n")
    try:
        bad = unknown_flags([probe])
    finally:
        probe.unlink()
    assert bad == ["docs/_flag_scan_probe.md:1: --vllm_is_correction", "docs/_flag_scan_probe.md:3: --locked",
                   "docs/_flag_scan_probe.md:4: --ds_tensor_parallel_size"]


@pytest.mark.parametrize("cmd", ["ppo", "ppo-ray", *train.COMMANDS])
def test_every_flag_has_help(cmd):
    groups = ppo._groups(cmd == "ppo-ray") if cmd.startswith("ppo") else train._groups(train.COMMANDS[cmd])
    parser, flags = build_parser("rl", "", groups)
    missing = [f.dotted for f in flags if f.kwargs["help"].startswith("default:")]
    assert not missing, f"rl {cmd}: fields without help metadata: {missing}"
