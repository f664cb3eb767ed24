"""RL losses, advantages, tasks, rewards and the training loop (dtarl.rl.trainer)."""

# dtarl.engines must be imported before dtarl.rl.losses: engines.base imports
# rl.losses, which imports engines.batch; starting from `import dtarl.rl` would
# otherwise hit a partially initialised dtarl.rl.losses (circular import).
import dtarl.engines  # noqa: F401, I001
from dtarl.rl.losses import ClippedSurrogateLoss, MaskedNLLLoss, SequenceData, TokenData

__all__ = ["ClippedSurrogateLoss", "MaskedNLLLoss", "SequenceData", "TokenData"]
