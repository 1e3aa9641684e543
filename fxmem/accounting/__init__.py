"""Accounting: from a recording to formulas in the user's dims and exact numbers at given dims.

:class:`~.plan.MemoryPlan` converts the recording into the user's dims and walks its events once
symbolically (the formulas) and once per set of dims numerically (:class:`~.plan.Evaluation`, with
the node-by-node :class:`~.replay.Liveness` the views draw); :mod:`.symbolic` keeps the ``Max`` of a
peak readable; :mod:`.budget` finds the largest size that fits.

>>> plan = MemoryPlan(recording, hints)       # doctest: +SKIP
"""
from ..units import parse_bytes
from .budget import max_size
from .plan import CUDA_BLOCK, FORMULA_KEYS, TRAIN_KEYS, Evaluation, MemoryPlan, cuda_block_bytes
from .replay import Liveness, StepColumn, StepLiveness

__all__ = ["MemoryPlan", "Evaluation", "Liveness", "max_size", "parse_bytes", "cuda_block_bytes", "CUDA_BLOCK",
           "FORMULA_KEYS", "TRAIN_KEYS", "StepLiveness", "StepColumn"]
