"""Rewrites that make a model take less memory, each verified: ``fxmem.optimize``.

This folder is the top-level ``passes/`` of the source tree, installed as ``fxmem.passes``:

* :mod:`.optimize` - ``fxmem.optimize``: trace, probe at small sizes, find, apply, verify, keep
  what lowers the peak;
* :mod:`.verify` - same outputs and gradients as the original, in train and eval mode;
* :mod:`.registry` - the passes, as data; :mod:`.base` - what a pass is;
* the pair-linear rule: :mod:`.pair_linear` (the rule), :mod:`.data_movement` (which nodes only
  copy elements, and the id probe), :mod:`.linear_maps` (what counts as a linear map),
  :mod:`.pair_layout` (how the pair tensor is laid out), :mod:`.pair_reasons` (why a look-alike
  is declined).

>>> opt = fxmem.optimize(layer, ("B", "N", 6), ("B", "N", "N"))          # doctest: +SKIP
"""
from .base import Finding, Pass, Probe
from .optimize import optimize
from .registry import PASSES
from .verify import Difference, compare

__all__ = ["optimize", "compare", "Difference", "PASSES", "Pass", "Finding", "Probe"]
