"""RL losses (and, later, advantages and the training loop) as pure functions."""

from dtarl.rl.losses import ClippedSurrogateLoss, MaskedNLLLoss, SequenceData, TokenData

__all__ = ["ClippedSurrogateLoss", "MaskedNLLLoss", "SequenceData", "TokenData"]
