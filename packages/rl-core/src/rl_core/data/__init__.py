"""rl_core.data: local data files -> tokenized prompt, SFT, preference and KTO datasets -> batches.

``load_rows`` reads .jsonl / .json / .parquet / save_to_disk folders keeping each row's
source for error messages (``training_rows`` mixes several by probability, as OpenRLHF's
``--dataset_probs``); the datasets tokenize eagerly under a :class:`DataConfig`
and report what they kept; the collate functions pad, pair or pack. Loss masks are
aligned with ``input_ids`` (``loss_mask[t] == 1``: token ``t`` is a target, predicted
from position ``t - 1``). Leaves out hub downloads, streaming and samplers.

The names below load on first use (PEP 562): importing a light module of the package (a config) imports no
torch.
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rl_core.data.blending import blend_rows, training_rows
    from rl_core.data.collate import (
        model_inputs,
        pack_collate,
        pack_greedy,
        pad_collate,
        preference_collate,
        sequence_sums,
    )
    from rl_core.data.config import DataConfig
    from rl_core.data.datasets import (
        DataReport,
        KTODataset,
        PreferenceDataset,
        PretrainDataset,
        PromptDataset,
        SFTDataset,
    )
    from rl_core.data.encoding import Encoded
    from rl_core.data.loading import DataError, MissingDataFile, Row, load_rows

# name -> the submodule that defines it, imported on first use
_LAZY = {
    **dict.fromkeys(("blend_rows", "training_rows"), "rl_core.data.blending"),
    **dict.fromkeys(
        ("model_inputs", "pack_collate", "pack_greedy", "pad_collate", "preference_collate", "sequence_sums"),
        "rl_core.data.collate",
    ),
    "DataConfig": "rl_core.data.config",
    **dict.fromkeys(
        ("DataReport", "KTODataset", "PreferenceDataset", "PretrainDataset", "PromptDataset", "SFTDataset"),
        "rl_core.data.datasets",
    ),
    "Encoded": "rl_core.data.encoding",
    **dict.fromkeys(("DataError", "MissingDataFile", "Row", "load_rows"), "rl_core.data.loading"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # the next access skips this function
        return value
    raise AttributeError(f"module 'rl_core.data' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


__all__ = [
    "DataConfig",
    "DataError",
    "DataReport",
    "Encoded",
    "KTODataset",
    "MissingDataFile",
    "PreferenceDataset",
    "PretrainDataset",
    "PromptDataset",
    "Row",
    "SFTDataset",
    "blend_rows",
    "load_rows",
    "model_inputs",
    "pack_collate",
    "pack_greedy",
    "pad_collate",
    "preference_collate",
    "sequence_sums",
    "training_rows",
]
