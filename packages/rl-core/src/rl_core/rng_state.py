"""A process's random number generators' state (Python's, torch's, CUDA's), read, set, and as JSON values so that
a state file needs no pickle to read back: what checkpoints keep for an exact resume."""

from __future__ import annotations

import base64
import random

import torch


def rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def rng_state_json(state: dict | None = None) -> dict:
    """:func:`rng_state` (default: now) as JSON values, so that a state file needs no pickle to read back."""
    state = rng_state() if state is None else state
    version, internal, gauss = state["python"]
    out = {"python": [version, list(internal), gauss], "torch": _b64(state["torch"])}
    if "cuda" in state:
        out["cuda"] = [_b64(t) for t in state["cuda"]]
    return out


def rng_state_from_json(d: dict) -> dict:
    """The inverse of :func:`rng_state_json`: a state :func:`set_rng_state` takes."""
    version, internal, gauss = d["python"]
    out = {"python": (version, tuple(internal), gauss), "torch": _unb64(d["torch"])}
    if "cuda" in d:
        out["cuda"] = [_unb64(x) for x in d["cuda"]]
    return out


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode("ascii")


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()
