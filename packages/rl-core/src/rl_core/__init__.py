"""rl_core: models, DeepSpeed training, data, trainers and checkpoints.

Filled in by the rl-core issue; today it owns the attention-implementation switch.
It never imports Ray or rl-placement: its loops talk to worker-group protocols.
"""

from rl_core.attention import attention_implementation

__version__ = "0.1.0"

__all__ = ["attention_implementation"]
