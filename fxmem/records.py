"""What a simulated run leaves behind: storages, the aten steps that allocated them, fx nodes (or
source lines), and the ordered events between them. The vocabulary every room shares.

The simulation (:mod:`fxmem.simulation`) writes these with sizes over PyTorch's ShapeEnv symbols;
the accounting (:mod:`fxmem.accounting`) turns them into the user's dims and formulas; the report
and its views read the user-space copies. One class per concept, in both spaces.

>>> Role.ACTIVATION.resident, Role.PARAMETER.resident
(False, True)
>>> str(SavedBy("matmul_1", "aten.mm"))
'matmul_1 (aten.mm)'
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Any

import sympy
import torch

from .capture.source import SourceLine
from .specs import dim_symbol


class Role(str, enum.Enum):
    """What a storage is to the run. Resident roles exist before the run and after it."""

    PARAMETER = "parameter"
    BUFFER = "buffer"
    INPUT = "input"
    CONSTANT = "constant"  # a tensor attribute of a module, or a tensor made outside the run
    ACTIVATION = "activation"  # allocated by the run
    GRADIENT = "gradient"  # a parameter's ``.grad``, allocated by backward
    OPTIMIZER_STATE = "optimizer_state"  # created before the steady-state step, held through it

    @property
    def resident(self) -> bool:
        """Held before the forward starts and after it returns (parameters, buffers, inputs)."""
        return self in (Role.PARAMETER, Role.BUFFER, Role.INPUT, Role.CONSTANT)

    def __str__(self) -> str:
        return self.value


class Phase(str, enum.Enum):
    """The part of a training step an allocation belongs to."""

    FORWARD = "forward"
    LOSS = "loss"
    BACKWARD = "backward"
    STEP = "optimizer.step"
    ZERO_GRAD = "zero_grad"
    RETURN = "return"

    def __str__(self) -> str:
        return self.value


@dataclasses.dataclass(frozen=True)
class SavedBy:
    """Autograd keeps a storage for the backward of ``op``, recorded at fx node (or line) ``node``."""

    node: str
    op: str

    def __str__(self) -> str:
        return f"{self.node} ({self.op})"


@dataclasses.dataclass
class Storage:
    """One storage: how big (bytes, a sympy expression), what it is, who made it and who keeps it.

    ``step`` is the index of the aten step that allocated it, None for storages that exist before
    the run (parameters, buffers, inputs, constants, optimizer state). ``freed_at`` (the fx node by
    whose end it had been freed - in a training step, by backward or later; None if never freed,
    ``"<return>"`` if freed as the run returns), ``kept_after_forward`` and ``module`` are filled in
    by the accounting.
    """

    index: int
    bytes: sympy.Expr
    dtype: torch.dtype
    shape: tuple
    role: Role
    name: str
    node: str | None = None
    op: str | None = None
    step: int | None = None
    phase: Phase = Phase.FORWARD
    saved_by: list = dataclasses.field(default_factory=list)  # [SavedBy]
    is_output: bool = False
    freed_at: str | None = None
    module: str = ""
    kept_after_forward: bool = False  # allocated by the forward and alive when it returns (training too)
    copy_of: int | None = None  # for a copy (aten.clone, aten._to_copy): the storage it copies

    @property
    def is_copy(self) -> bool:
        """Whether this storage holds a copy of another one's data (a contiguous or dtype copy)."""
        return self.copy_of is not None

    @property
    def kind(self) -> str:
        """The role as a plain string (``"activation"``, ``"parameter"``, ...)."""
        return self.role.value

    def to_dict(self) -> dict:
        return {"index": self.index, "module": self.module, "bytes": str(self.bytes),
                "dtype": str(self.dtype).replace("torch.", ""), "shape": [str(d) for d in self.shape],
                "role": self.role.value, "name": self.name, "node": self.node, "op": self.op,
                "saved_by": [str(s) for s in self.saved_by], "freed_at": self.freed_at, "is_output": self.is_output,
                "kept_after_forward": self.kept_after_forward,
                "copy_of": self.copy_of}


@dataclasses.dataclass
class Step:
    """One aten call that allocated (or used hidden scratch): the storages it created, in order, and
    its hidden-allocation program (byte deltas with ``OUT`` where the outputs appear, and
    :class:`Placed` where one output storage appears at its own moment; [] if none). ``reads``: the
    recorded storages its tensor arguments live in."""

    index: int
    node: str
    op: str
    allocs: list
    program: list
    phase: Phase = Phase.FORWARD
    reads: tuple = ()  # storages of the op's tensor arguments (who the step works for: see simulation.repeats)


@dataclasses.dataclass(frozen=True)
class Placed:
    """In a step's program: storage ``storage`` (one of the step's allocations) is allocated here,
    not with the others at ``OUT``."""

    storage: int


@dataclasses.dataclass
class Node:
    """One fx node (graph mode), executed source line (eager mode) or training phase.

    The simulation fills what the node is and did (``shapes``, ``dtypes``, ``outputs`` - storage
    index per tensor output - and the steps ``[first_step, end_step)``); the accounting adds the
    byte columns of the per-node table: ``allocations``, ``allocated``, ``saved``, ``live_after``.
    """

    name: str
    op: str  # placeholder | call_function | ... | line | phase
    target: str
    module: str
    source: SourceLine | None
    shapes: list  # output shapes (tuples of sympy), one per tensor output
    dtypes: list
    outputs: list  # storage index (or None) per tensor output
    first_step: int
    end_step: int
    value: Any = None  # a size the node computes (x.size(1) ...)
    allocations: list = dataclasses.field(default_factory=list)  # [Storage]
    allocated: sympy.Expr = sympy.Integer(0)
    saved: sympy.Expr = sympy.Integer(0)  # bytes of this node's allocations autograd keeps
    live_after: sympy.Expr = sympy.Integer(0)  # activation bytes live when it ends (above resident)

    def to_dict(self) -> dict:
        return {"name": self.name, "op": self.op, "target": self.target, "module": self.module,
                "source": str(self.source) if self.source else None,
                "code": self.source.code if self.source else None,
                "shapes": [[str(d) for d in s] for s in self.shapes],
                "dtypes": [str(d).replace("torch.", "") for d in self.dtypes],
                "allocations": [a.index for a in self.allocations], "allocated": str(self.allocated),
                "saved": str(self.saved), "live_after": str(self.live_after),
                "value": str(self.value) if self.value is not None else None}


# Every note that says some number of a report may differ from a real run contains this phrase
# (``Report.exact`` is False then); other notes say how numbers were obtained, exactly.
INEXACT = "numbers may not be exact"

# Event kinds of a Recording, in the order they happened.
FREE, STEP, NODE = "free", "step", "node"


@dataclasses.dataclass
class Recording:
    """Everything one simulated run saw, in ShapeEnv symbols.

    ``events`` is the run in order: ``(FREE, storage)``, ``(STEP, step)``, ``(NODE, node)`` (the end
    of an fx node, line, or training phase). Replaying it gives the live bytes at every moment.
    ``events[:forward_end]`` is the forward; a training step continues with the phases.
    """

    storages: list
    steps: list
    nodes: list
    events: list
    notes: list
    env: Any  # the ShapeEnv
    env_symbols: dict  # user dim name -> ShapeEnv symbol (or a number if PyTorch specialised it)
    device: str
    forward_end: int = -1
    training: bool = False
    graph_module: Any = None  # the GraphModule that ran (graph mode)
    facts: dict = dataclasses.field(default_factory=dict)  # what else decided the numbers (threads ...)
    data_dims: dict = dataclasses.field(default_factory=dict)  # dim name -> DataDim (sizes values decide)
    # eager mode: module path -> ModuleCall (class, calls, first output shape); None in graph mode
    module_calls: dict | None = None
    # the fitted kernel programs it used (fxmem.kernels.calibrate.Fit), checked at each size asked
    fits: list = dataclasses.field(default_factory=list)
    # with parallelize=: each DTensor parameter as ``(name, global shape, ((mesh dim, tensor dim), ...))``,
    # the mesh dims that shard it (fxmem.distributed.world_symbol reads which sizes divide evenly)
    sharded: list = dataclasses.field(default_factory=list)
    # dims that are no ShapeEnv symbol (a world size made a symbol by fitting several runs,
    # fxmem.distributed.world_symbol): ``{name: lower bound}``, and their conditions (``4096 % W == 0``)
    outer_dims: dict = dataclasses.field(default_factory=dict)
    outer_guards: list = dataclasses.field(default_factory=list)

    @property
    def forward_events(self) -> list:
        return self.events[:self.forward_end] if self.forward_end >= 0 else self.events

    def user_map(self) -> dict:
        """ShapeEnv symbol -> user symbol (dims PyTorch specialised to a number have none)."""
        return {s: dim_symbol(name) for name, s in self.env_symbols.items() if isinstance(s, sympy.Symbol)}
