"""Fused operators that ``fxmem.optimize`` puts in place of memory-hungry subgraphs.

Each is a ``torch.library`` custom op in the ``fxmem`` namespace with a pure-PyTorch kernel (so it
runs wherever PyTorch runs), a fake kernel (its outputs' shapes, for fake tensors and symbolic
sizes) and autograd. What a kernel allocates beyond its outputs is described, like every other
kernel's, by rules in :mod:`fxmem.kernels.fused`, keyed by these ops and checked against real runs.

* :mod:`.attention` - masked softmax attention over decomposed (GAT) scores, in row blocks;
* :mod:`.spmm` - gather -> message -> scatter-add as one sparse-dense product over a CSR adjacency.
"""
from . import attention, spmm  # noqa: F401 - defines the ops

__all__ = ["attention", "spmm"]
