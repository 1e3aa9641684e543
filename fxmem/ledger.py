"""The ledger: every storage a simulated run allocates, with its symbolic size, birth and death.

A dispatch mode (:class:`Recorder`) sees each aten op below autograd and composite
decompositions, so it sees the internal copies ``matmul`` makes, not just the fx node that asked
for them; a weak reference per storage says exactly when it dies (when the real allocator would
free it); autograd's saved-tensor hook says what is kept for backward. The ledger writes all of
it down as events, in order, for :mod:`fxmem.memory_plan` to replay.

>>> ledger = Ledger(env, "cpu")                      # doctest: +SKIP
>>> with Recorder(ledger): out = model(x)            # doctest: +SKIP
>>> ledger.events[:3]                                # doctest: +SKIP
[('step', 0), ('free', 4), ('step', 1)]
"""
from __future__ import annotations

import contextlib
import dataclasses
import weakref
from typing import Any

import sympy
import torch

from . import _torch_compat as tc
from . import hidden
from .errors import UnsupportedOpError
from .tracing import SourceLine

# ops that never allocate and are too frequent to be worth a look
_SKIP = {"prim.device", "aten.sym_size", "aten.sym_stride", "aten.sym_numel", "aten.sym_storage_offset",
         "aten.is_contiguous", "aten.is_same_size", "aten.is_non_overlapping_and_dense"}
_LIFT = {"aten.lift_fresh", "aten.lift_fresh_copy"}


@dataclasses.dataclass
class StorageRecord:
    """One storage: how big (bytes, env-space sympy), what it is, when it is born and dies.

    ``alloc_step`` is None for resident storages (parameters, buffers, inputs, constants).
    ``freed`` says whether it died before the forward returned (its ``("free", index)`` event in
    ``Recording.events`` says when).
    """

    index: int
    nbytes: sympy.Expr
    dtype: torch.dtype
    shape: tuple
    kind: str  # parameter | buffer | input | constant | activation
    name: str
    node: str | None = None
    op: str | None = None
    alloc_step: int | None = None
    freed: bool = False
    saved_by: list = dataclasses.field(default_factory=list)  # [(node, op)]
    is_output: bool = False
    role: str = ""  # "gradient" for a parameter's .grad, "optimizer_state" for optimizer state
    phase_backward: bool = False  # allocated by the backward pass (a gradient temporary)


@dataclasses.dataclass
class Step:
    """One aten op that allocated (or hid scratch): which storages it created and its program."""

    index: int
    node: str
    op: str
    allocs: list
    program: list  # hidden-allocation program (env-space exprs and hidden.OUT); [] if none
    phase: str = "forward"


@dataclasses.dataclass
class NodeRecord:
    """What one fx node did: its outputs' shapes and the steps it ran."""

    name: str
    op: str
    target: str
    module: str
    source: SourceLine | None
    outputs: list  # [(shape tuple of env exprs, dtype, storage index or None)] per tensor output
    first_step: int
    end_step: int  # steps [first_step, end_step) belong to this node
    value: Any = None  # non-tensor result (SymInt expr, ...) for the table


@dataclasses.dataclass
class Recording:
    """Everything :func:`simulate` saw, in ShapeEnv symbols.

    ``events`` is the run in order: ``("free", storage)``, ``("step", step)``, ``("node", node)``
    (the end of an fx node, or of a training phase). Replaying it gives live bytes at every moment.
    ``events[:forward_end]`` is the forward; a training step continues with the phases ``loss``,
    ``backward``, ``optimizer.step``, ``zero_grad`` and ``return``.
    """

    storages: list
    steps: list
    nodes: list
    events: list
    notes: list
    env: Any
    env_symbols: dict  # user name -> env symbol
    device: str
    forward_end: int = -1
    training: bool = False
    graph_module: Any = None  # the GraphModule that ran (graph mode)

    def user_map(self) -> dict:
        """ShapeEnv symbol -> user symbol (dims PyTorch specialised to a constant, e.g. 1, have none)."""
        from .specs import dim_symbol

        return {s: dim_symbol(name) for name, s in self.env_symbols.items() if isinstance(s, sympy.Symbol)}


class Ledger:
    def __init__(self, env: Any, device: str):
        self.env = env
        self.device = device
        self.storages: list[StorageRecord] = []
        self.steps: list[Step] = []
        self.events: list[tuple[str, int]] = []
        self.live: dict[int, tuple[Any, int]] = {}  # activations: cdata -> (weakref, storage index)
        self.resident: dict[int, tuple[Any, int]] = {}  # never freed during the run: not polled
        self.node = "<input>"
        self.phase = "forward"
        self.engine_gap = False  # the autograd engine is between two nodes
        self.last_op = None
        self.pending_packs: list[int] = []
        self.notes: list[str] = []
        self.quiet_depth = 0
        self.keeps: dict[str, list[int]] = {}  # fx node -> hidden storages autograd keeps, not yet bound
        self._unbound: list[tuple[Any, str, list[int]]] = []  # (weakref to op output, node, keeps)

    def release_keeps(self, node: str) -> None:
        """The backward of ``node`` ran: autograd released what it kept for it (fallback when the
        op's own autograd node could not be found)."""
        self._release(self.keeps.pop(node, []))

    def _release(self, indices: list[int]) -> None:
        for idx in indices:
            if not self.storages[idx].freed:
                self.storages[idx].freed = True
                self.events.append(("free", idx))

    def _bind_keeps(self) -> None:
        # Autograd attaches an op's grad_fn after the op returns, so this runs at the next op: the
        # kept storages die when that node's backward has run (and it releases its variables).
        for ref, node, indices in self._unbound:
            t = ref()
            fn = getattr(t, "grad_fn", None) if t is not None else None
            if fn is None:
                continue
            fn.register_hook(lambda *_, indices=indices: self._release(indices))
            left = [i for i in self.keeps.get(node, []) if i not in indices]
            if left:
                self.keeps[node] = left
            else:
                self.keeps.pop(node, None)
        self._unbound.clear()

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    @contextlib.contextmanager
    def quiet(self) -> Any:
        """Fake computations in here are not part of the model (shape probes)."""
        self.quiet_depth += 1
        try:
            yield
        finally:
            self.quiet_depth -= 1

    # --- storages -------------------------------------------------------------------------------
    def _counts(self, t: torch.Tensor) -> bool:
        return t.device.type == self.device

    def lookup(self, t: torch.Tensor) -> int | None:
        ref = tc.storage_key(t)
        hit = self.live.get(ref.cdata) or self.resident.get(ref.cdata)
        if hit is None or hit[0].expired():
            return None
        return hit[1]

    def add(self, t: torch.Tensor, kind: str, name: str, step: int | None = None, op: str | None = None) -> int | None:
        if not self._counts(t):
            return None
        known = self.lookup(t)
        if known is not None:
            return known
        nbytes = tc.size_expr(self.env, tc.storage_nbytes(t))
        shape = tuple(tc.size_expr(self.env, d) for d in t.shape)
        for e in (nbytes, *shape):
            if tc.unbacked_symbols(e):
                raise UnsupportedOpError(
                    f"{op or kind} at fx node '{self.node}' makes a tensor whose size depends on the data "
                    f"(shape {tuple(t.shape)}); fxmem gives formulas in input sizes only. Give that size "
                    f"as an input (e.g. an index tensor of shape ('E',)) instead of computing it from values."
                )
        rec = StorageRecord(len(self.storages), nbytes, t.dtype, shape, kind, name,
                            node=self.node if step is not None else None, op=op, alloc_step=step)
        self.storages.append(rec)
        ref = tc.storage_key(t)
        (self.live if step is not None else self.resident)[ref.cdata] = (ref, rec.index)
        return rec.index

    def poll(self) -> None:
        """Record every tracked storage that died since the last poll."""
        dead = [k for k, (ref, _) in self.live.items() if ref.expired()]
        for k in dead:
            _, idx = self.live.pop(k)
            self.storages[idx].freed = True
            self.events.append(("free", idx))

    # --- ops ------------------------------------------------------------------------------------
    def record(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        if self.quiet_depth:
            return
        if self._unbound:
            self._bind_keeps()
        name = tc.op_name(func)
        outs = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        program = hidden.program_for(func, args, kwargs, tuple(outs), self.device, torch.is_grad_enabled(), self.phase)
        if not outs and not self.pending_packs and not program:  # e.g. in-place _foreach ops
            return
        # Frees only matter before something is allocated (and at node ends): a view or an
        # in-place op allocates nothing, so it needs no poll.
        if program or any(self._counts(t) and self.lookup(t) is None for t in outs):
            self.poll()
        arg_tensors = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        if tc.op_packet_name(func) not in _LIFT:
            for a in arg_tensors:  # a fake tensor made outside the recorder: treat as a constant
                if self._counts(a) and self.lookup(a) is None:
                    self.add(a, "constant", f"{self.node}:{name}")
        self._resolve_packs({self.lookup(a) for a in arg_tensors}, name)
        step = len(self.steps)
        if self.phase == "backward" and (
                (self.engine_gap and self._accumulates_in_place(func, args, outs))
                or self._fills_fresh_zeros(func, args, outs)):
            return
        new = []
        for t in outs:
            if self._counts(t) and self.lookup(t) is None:
                idx = self.add(t, "activation", self.node, step=step, op=name)
                if idx is not None and self.phase == "backward":
                    self.storages[idx].phase_backward = True
                if idx is not None and self.storages[idx].nbytes == 0:
                    self.storages.pop()
                    self.live.pop(tc.storage_key(t).cdata)
                    continue
                new.append(idx)
        for i, nbytes in hidden.output_storage(func, args, kwargs, tuple(outs), self.device).items():
            idx = self.lookup(outs[i])
            if idx is not None and idx in new:  # the real kernel's storage is larger than the fake's
                self.storages[idx].nbytes = tc.size_expr(self.env, nbytes)
        for keep in [p for p in program if isinstance(p, hidden.Keep)]:
            # allocated before the op's outputs and alive until its backward ran: an allocation
            # of this step, freed by release_keeps() (it has no tensor whose death we could see)
            rec = StorageRecord(len(self.storages), sympy.Integer(keep.nbytes), keep.dtype, (), "activation",
                                self.node, node=self.node, op=name, alloc_step=step,
                                saved_by=[(self.node, name)])
            self.storages.append(rec)
            self.keeps.setdefault(self.node, []).append(rec.index)
            new.append(rec.index)
        for unknown in [p for p in program if isinstance(p, hidden.Unknown)]:
            note = f"node '{self.node}': {unknown.op} may use workspace fxmem cannot predict ({unknown.why})"
            if note not in self.notes:
                self.notes.append(note)
        kept = [i for i in new if self.storages[i].shape == () and i in self.keeps.get(self.node, [])]
        if kept and outs:
            self._unbound.append((weakref.ref(outs[0]), self.node, kept))
        program = [p for p in program if not isinstance(p, (hidden.Keep, hidden.Unknown))]
        if new or program:
            program = [p if p is hidden.OUT else tc.size_expr(self.env, p) for p in program]
            self.steps.append(Step(step, self.node, name, new, program, self.phase))
            self.events.append(("step", step))
        self.last_op = name

    def _accumulates_in_place(self, func: Any, args: tuple, outs: list) -> bool:
        """Emulate the engine's in-place gradient accumulation that fake tensors never get.

        ``InputBuffer::accumulate`` adds two gradients for the same input *in place* into one of
        them if it is a plain dense tensor it holds the last reference to (``can_accumulate_inplace``);
        for subclass-like (fake) tensors it always adds out of place. When the real engine would
        reuse a buffer, the fake sum takes over that buffer's record: no allocation, no free.
        """
        if tc.op_name(func) != "aten.add.Tensor" or len(outs) != 1 or len(args) < 2:
            return False
        for old in (args[0], args[1]):
            if not isinstance(old, torch.Tensor) or old.shape != outs[0].shape or old.dtype != outs[0].dtype:
                continue
            idx = self.lookup(old)
            if idx is None:
                continue
            rec = self.storages[idx]
            whole = sympy.expand(tc.size_expr(self.env, old.numel() * old.element_size()) - rec.nbytes) == 0
            if (rec.alloc_step is not None and rec.phase_backward and not rec.saved_by and not rec.is_output
                    and rec.role != "gradient" and whole and tc.non_overlapping_and_dense(old)):
                self.live.pop(tc.storage_key(old).cdata, None)
                ref = tc.storage_key(outs[0])
                self.live[ref.cdata] = (ref, idx)
                return True
        return False

    # Backward formulas that fill fresh zeros *in place* for real tensors but, for subclass-like
    # (fake) ones, out of place (FunctionsManual: index_select_backward, gather_backward,
    # value_selecting_reduction_backward ...): the fake result takes over the zeros' record.
    _IN_PLACE_FOR_REAL = {"aten.scatter", "aten.scatter_add", "aten.index_add", "aten.index_put",
                          "aten.masked_scatter", "aten.index_fill", "aten.index_copy"}
    _ZEROS = {"aten.zeros", "aten.new_zeros", "aten.zeros_like", "aten.full", "aten.new_full", "aten.full_like"}

    def _fills_fresh_zeros(self, func: Any, args: tuple, outs: list) -> bool:
        if tc.op_packet_name(func) not in self._IN_PLACE_FOR_REAL or len(outs) != 1 or not args:
            return False
        base = args[0]
        if not isinstance(base, torch.Tensor) or base.shape != outs[0].shape:
            return False
        idx = self.lookup(base)
        if idx is None:
            return False
        rec = self.storages[idx]
        fresh = (rec.phase_backward and rec.node == self.node and (rec.op or "").split(".")[0:2] and
                 ".".join((rec.op or "").split(".")[:2]) in self._ZEROS and not rec.saved_by)
        if not fresh:
            return False
        self.live.pop(tc.storage_key(base).cdata, None)
        ref = tc.storage_key(outs[0])
        self.live[ref.cdata] = (ref, idx)
        return True

    # --- autograd -------------------------------------------------------------------------------
    def mark_saved(self, t: torch.Tensor) -> None:
        if self.quiet_depth or not isinstance(t, torch.Tensor) or not self._counts(t):
            return
        idx = self.lookup(t)
        if idx is not None:
            self.pending_packs.append(idx)

    def _resolve_packs(self, this_op_inputs: set, this_op: str | None) -> None:
        # Autograd saves an op's inputs just before dispatching it and its outputs right after:
        # a pending pack of one of this op's inputs belongs to this op, the rest to the last one.
        for idx in self.pending_packs:
            op = this_op if (this_op is not None and idx in this_op_inputs) else self.last_op
            entry = (self.node, op or "?")
            if entry not in self.storages[idx].saved_by:
                self.storages[idx].saved_by.append(entry)
        self.pending_packs.clear()

    def end_node(self, poll: bool = True) -> None:
        if self._unbound:
            self._bind_keeps()
        self._resolve_packs(set(), None)
        if poll:
            self.poll()


class Recorder(tc.DispatchMode):
    def __init__(self, ledger: Ledger):
        super().__init__()
        self.ledger = ledger

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if tc.op_packet_name(func) not in _SKIP:
            self.ledger.record(func, args, kwargs, out)
        return out
