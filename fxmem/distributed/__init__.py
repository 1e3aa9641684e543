"""Many GPUs: one rank's memory under PyTorch's FSDP2 (``fully_shard``) or DDP, simulated in one process.

``fxmem.analyze(model, *specs, world_size=8, parallelize=fn, optimizer=...)`` runs the user's own
``fn(model, mesh)`` on fxmem's private fake copy of the model, inside torch's fake process group of
``world_size`` ranks (collectives do nothing; every buffer FSDP2 and DDP allocate around them is
real code on fake tensors), and records rank ``rank``'s training step like any other.

* :mod:`.parallel` - the option (world size, rank, the user's function) and the fake world it runs in.
* :mod:`.adopt` - a model the user wrapped already: its wrapping read and applied again to fxmem's copy.
* :mod:`.wrappers` - what fxmem does not model: refused with what to do.
"""
from .adopt import adopt, adopted_parallel
from .parallel import Parallel
from .wrappers import refuse_wrapped

__all__ = ["Parallel", "adopt", "adopted_parallel", "refuse_wrapped"]
