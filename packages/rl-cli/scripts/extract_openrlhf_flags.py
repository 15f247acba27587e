"""Extract OpenRLHF's command-line flags, per command, from its own argparse definitions.

Reads ``openrlhf/cli/train_*.py`` at given releases of a local OpenRLHF git clone
(``git show TAG:PATH``, nothing is imported or run) and writes
``rl_cli/openrlhf_flags.json``: for each of our commands, the flags of the flat dialect
(the releases up to v0.10.1, the ones our reference sheet describes) and of the grouped
dialect (``--actor.*``, ``--train.*`` ...: the latest release), with each flag's argparse
shape (action, nargs, type, choices, default), so :mod:`rl_cli.openrlhf` can check that
every one of them is either mapped onto our configs or refused.

    python packages/rl-cli/scripts/extract_openrlhf_flags.py /path/to/OpenRLHF/.git \
        > packages/rl-cli/src/rl_cli/openrlhf_flags.json

``OPENRLHF_GIT=/path/to/OpenRLHF/.git pytest packages/rl-cli/tests/test_openrlhf_flags.py`` checks
that the committed file is what this script reads (to move to a newer release, edit SOURCES).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys

# our command -> dialect -> [(tag, file)]; several sources are merged (a flag keeps its first shape)
SOURCES = {
    "sft": {"flat": [("v0.10.1", "train_sft.py")], "grouped": [("v0.11.0", "train_sft.py")]},
    "rm": {"flat": [("v0.10.1", "train_rm.py")], "grouped": [("v0.11.0", "train_rm.py")]},
    "dpo": {"flat": [("v0.10.1", "train_dpo.py")], "grouped": [("v0.11.0", "train_dpo.py")]},
    # train_kto.py left OpenRLHF after v0.9.5; its latest release has no KTO (no grouped dialect)
    "kto": {"flat": [("v0.9.5", "train_kto.py")], "grouped": []},
    # train_ppo.py (single controller) left after v0.6.1.post1; its users moved to train_ppo_ray, whose flags
    # `rl ppo` takes too (placement flags refused: rl ppo-ray)
    "ppo": {"flat": [("v0.10.1", "train_ppo_ray.py"), ("v0.6.1.post1", "train_ppo.py")],
            "grouped": [("v0.11.0", "train_ppo_ray.py")]},
    "ppo-ray": {"flat": [("v0.10.1", "train_ppo_ray.py")], "grouped": [("v0.11.0", "train_ppo_ray.py")]},
}


def _literal(node, env: dict[str, str] | None = None):
    if env is not None:  # a loop-variable comparison: evaluated on that name alone, nothing else in scope
        return eval(compile(node, "<openrlhf>", "eval"), {"__builtins__": {}}, dict(env))
    try:
        v = ast.literal_eval(node)
    except (ValueError, SyntaxError, TypeError):
        return ast.unparse(node)
    return v if isinstance(v, (str, int, float, bool, type(None), list, tuple)) and v == v and v not in (
        float("inf"), float("-inf")) else repr(v)


def _names(node, env: dict[str, str]) -> list[str]:
    """The option strings of one add_argument call; f-strings take the loop variable's value."""
    out = []
    for a in node.args:
        if isinstance(a, ast.Constant) and str(a.value).startswith("--"):
            out.append(a.value)
        elif isinstance(a, ast.JoinedStr):
            text = "".join(str(v.value) if isinstance(v, ast.Constant) else env.get(ast.unparse(v.value), "?")
                           for v in a.values)
            if text.startswith("--"):
                out.append(text)
    return out


def flags_of(source: str) -> dict[str, dict]:
    out: dict[str, dict] = {}

    def visit(node, env: dict[str, str]) -> None:
        if isinstance(node, ast.For) and isinstance(node.target, ast.Name) and isinstance(node.iter, (ast.Tuple, ast.List)):
            for v in node.iter.elts:  # `for prefix in ("actor", "critic"): add_argument(f"--{prefix}.adam.lr")`
                for child in node.body:
                    visit(child, {**env, node.target.id: _literal(v)})
            return
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
            shape = {}
            for kw in node.keywords:
                if kw.arg in ("action", "nargs", "choices", "default"):
                    v = _literal(kw.value)
                    if isinstance(kw.value, ast.IfExp) and env:  # `1e-6 if prefix == "actor" else 9e-6`
                        branch = kw.value.body if _literal(ast.Expression(kw.value.test), env) else kw.value.orelse
                        v = _literal(branch)
                    shape[kw.arg] = list(v) if isinstance(v, tuple) else v
                elif kw.arg == "type":
                    shape["type"] = ast.unparse(kw.value)
            for n in _names(node, env):
                out.setdefault(n[2:], shape)
        for child in ast.iter_child_nodes(node):
            visit(child, env)

    visit(ast.parse(source), {})
    return out


def main(git_dir: str) -> None:
    def git(*a: str) -> str:
        return subprocess.run(["git", "--git-dir", git_dir, *a], check=True, capture_output=True, text=True).stdout

    data: dict = {"source": "https://github.com/OpenRLHF/OpenRLHF", "releases": {}, "commands": {}}
    for cmd, dialects in SOURCES.items():
        data["commands"][cmd] = {}
        for dialect, sources in dialects.items():
            flags: dict[str, dict] = {}
            for tag, file in sources:
                commit = git("rev-parse", f"{tag}^{{commit}}").strip()
                data["releases"][tag] = commit
                for name, shape in flags_of(git("show", f"{tag}:openrlhf/cli/{file}")).items():
                    flags.setdefault(name, {**shape, "from": f"{tag}:openrlhf/cli/{file}"})
            data["commands"][cmd][dialect] = dict(sorted(flags.items()))
    json.dump(data, sys.stdout, indent=1, sort_keys=False)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main(sys.argv[1])
