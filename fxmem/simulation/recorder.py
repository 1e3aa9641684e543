"""The recorder: a dispatch mode that sees every aten call of a simulated run and writes it down.

A dispatch mode sits below autograd and composite decompositions, so it sees the internal copies
``matmul`` makes, not just the fx node that asked for them. For each call it asks the kernel
registry (:mod:`fxmem.kernels`) what the real kernel would do beyond the fake one, records new
storages in the :class:`~.storages.StorageTable`, attributes saved tensors (:class:`~.autograd.Autograd`)
and appends the step to the :class:`~.events.EventLog`.

>>> recorder = Recorder(table, log, autograd, "cpu")                 # doctest: +SKIP
>>> with recorder: out = model(x)                                     # doctest: +SKIP
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import sympy
import torch

from .. import _torch_compat as tc
from .. import kernels
from ..capture import running_line
from ..distributed.labels import collective_name
from ..kernels import OUT, Call, Keep, OutAt, Unknown
from ..kernels.measured import MeasuredBytes
from ..records import INEXACT, Placed, Role, SavedBy, Storage
from .autograd import Autograd
from .events import EventLog
from .failures import NotModelled
from .storages import StorageTable
from .values import KnownValues

aten = torch.ops.aten
# ops that never allocate and are too frequent to be worth a look
_SKIP = frozenset({torch.ops.prim.device, aten.sym_size, aten.sym_stride, aten.sym_numel, aten.sym_storage_offset,
                   aten.is_contiguous, aten.is_same_size, aten.is_non_overlapping_and_dense})
# ops that turn a tensor made outside the run into one of the run's (not a constant of the model)
_LIFT = frozenset({aten.lift_fresh, aten.lift_fresh_copy})
# ops whose output is a copy of their first argument's data (the views name it: "contiguous copy of q")
_COPIES = frozenset({aten.clone, aten._to_copy})
# ``t.device`` of a fake tensor: the most frequent call by far, a query whose answer is no tensor
# (no value, no size, no storage, nothing to record), answered before any of the bookkeeping below
_DEVICE = torch.ops.prim.device.default
# torch.profiler.record_function: FSDP2 labels each step of its schedule with the group's module
_LABEL_OPS = tc.record_function_ops()
_ATTENTION = tc.attention_ops()


class Recorder(tc.DispatchMode):
    def __init__(self, table: StorageTable, log: EventLog, autograd: Autograd, device: str,
                 values: KnownValues | None = None):
        super().__init__()
        self.table, self.log, self.autograd, self.device = table, log, autograd, device
        self.values = values or KnownValues(log.note)  # tensors whose values the user stated
        self.used: set = set()  # kernel rules that shaped the numbers
        self.rename: Any = lambda text: text  # torch's size symbols -> the user's dims, in messages
        self._quiet = 0
        self._last_op: str | None = None
        self._checked: dict = {}  # calls run for real once (see fxmem.kernels.accepts)
        self._labels: list = []  # open record_function labels: (handle, the name they give buffers)
        # a DTensor op (FSDP2's sharded parameters, gradients, optimizer state) is declined: DTensor's
        # own dispatch then runs it as ops on the local shards, and those are what this rank allocates
        self._dtensor = tc.dtensor_type_if_loaded()

    def _label(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """Follow profiler labels; storages allocated inside a collective's are named after it."""
        out = func(*args, **kwargs)
        if "enter" in func.name():
            self._labels.append((out, collective_name(str(args[0])) if args else None))
        elif self._labels:  # record_function is a context manager: labels close innermost first
            self._labels.pop()
        return out

    @property
    def buffer_name(self) -> str | None:
        """The collective whose buffers are being allocated (None: the model's own code)."""
        for _, name in reversed(self._labels):
            if name is not None:
                return name
        return None

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is _DEVICE:
            return func(*args, **(kwargs or {}))
        if self._dtensor is not None and self._dtensor in types:
            return NotImplemented
        if func in _LABEL_OPS:
            return self._label(func, args, kwargs)
        if func in _ATTENTION and tc.context_parallel_active():
            raise NotModelled(
                "context parallelism (torch's context_parallel / _ContextParallel) is not modelled yet: its ring "
                "attention holds the key and value shards it rotates between ranks, which fxmem's kernels do not "
                "count; analyse the step without it (with FSDP2, tensor parallelism, HSDP or pipeline stages)")
        kwargs = kwargs or {}
        known, value = self.values.read(func, args)
        if known:  # bool(t) / t.item() of a tensor whose value the user stated: what the real run reads
            return value
        symbolic = kernels.symbolic_impl(func, self.device)
        if symbolic is not None:  # the fake kernel would read sizes as numbers (fixing the user's dims)
            out = symbolic.fn(*args, **kwargs)
            if not self._quiet:
                self.used.add(symbolic)
        else:
            try:
                out = func(*args, **kwargs)
            except (RuntimeError, ValueError, IndexError, TypeError, AssertionError) as exc:
                if isinstance(exc, tc.DATA_DEPENDENT_ERRORS + tc.UNSUPPORTED_OP_ERRORS):
                    raise
                # the user's shapes, or a limit of the fake kernel? The real kernel decides
                at = kernels.real_accepts(Call(func, args, kwargs, (), self.device), self.table.env)
                if at is None:
                    raise
                raise kernels.FakeKernelFails(tc.op_name(func), exc, at) from exc
        out = self._real_layout(func, args, kwargs, out)
        if self.table.data_dims is not None:  # a size only the values decide becomes a named dim
            self.table.data_dims.found(func, args, out, lambda: running_line() or f"fx node '{self.log.node}'",
                                       self.table.env)
        self.values.follow(func, args, kwargs, out)
        if not self._quiet and tc.op_packet(func) not in _SKIP:
            self._record(func, args, kwargs, out)
        return out

    def _real_layout(self, func: Any, args: tuple, kwargs: dict, out: Any) -> Any:
        """Outputs laid out as the real kernel lays them out (an OUTPUT_LAYOUT rule): fresh fake
        tensors in that memory format replace the fake kernel's."""
        if not isinstance(out, (torch.Tensor, tuple, list)):
            return out
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        tensors = [t for t in outs if isinstance(t, torch.Tensor)]
        wanted = kernels.output_layout(Call(func, args, kwargs, tuple(tensors), self.device))
        if not wanted:
            return out
        k = -1
        for i, t in enumerate(outs):
            if isinstance(t, torch.Tensor):
                k += 1
                if k in wanted and not t.is_contiguous(memory_format=wanted[k]):
                    outs[i] = torch.empty(t.shape, dtype=t.dtype, device=t.device, memory_format=wanted[k])
        return type(out)(outs) if isinstance(out, (tuple, list)) else outs[0]

    @contextlib.contextmanager
    def quiet(self) -> Iterator[None]:
        """Fake computations in here are not part of the model (shape probes, optimizer set-up)."""
        self._quiet += 1
        try:
            yield
        finally:
            self._quiet -= 1

    def saved(self, t: torch.Tensor) -> torch.Tensor:
        """The saved-tensor hook: autograd packs ``t``; what is kept is a detached alias (see
        :func:`fxmem._torch_compat.saved_tensor_hooks`: keeping ``t`` would keep its graph alive)."""
        if not self._quiet:
            self.autograd.saved(t)
        with self.quiet():
            return t.detach()

    def external(self, t: torch.Tensor, name: str) -> None:
        """A real tensor library code allocated outside any aten op (see :mod:`.outside`)."""
        table, log = self.table, self.log
        if self._quiet or not table.counts(t) or table.lookup(t) is not None:
            return
        self.poll()
        index = table.add(t, Role.ACTIVATION, log.node, node=log.node, step=log.next_step, op=name, phase=log.phase)
        if index is not None:
            log.step(name, [index], [])

    def _unrecorded(self, t: torch.Tensor, op: str) -> None:
        """An argument whose storage the table does not know: a tensor made outside the run (a
        constant, resident), unless the run made it and fxmem lost its record - a buffer fxmem said
        the engine reused in place while something still held it. That one is never resident (it
        was born in the run and dies in it): an activation from here on, and the numbers are not
        exact (its bytes from its birth to here, and the reuse's output, were counted wrong)."""
        table, log = self.table, self.log
        moved = table.moved_from(t)
        if moved is None:
            table.add(t, Role.CONSTANT, f"{log.node}:{op}")
            return
        self.poll()
        lost = table.storages[moved]
        index = table.add(t, Role.ACTIVATION, f"{log.node}:{op}", node=log.node, step=log.next_step, op=op,
                          phase=log.phase)
        if index is not None:
            log.step(op, [index], [])
        log.note_at(f"'{log.node}'", f"{lost.op} at '{lost.node}' made a buffer that fxmem counted as reused in "
                                     f"place later, but it is still in use here (the real run cannot have reused "
                                     f"it); {INEXACT}")

    def resized(self, storage: Any, old: int, new: int) -> None:
        """A storage resized in place: a free of its old bytes and an allocation of its new ones."""
        if self._quiet or old == new:
            return
        table, log = self.table, self.log
        self.poll()
        freed, index = table.resized(storage, old, new, Role.ACTIVATION, self.buffer_name or log.node, node=log.node,
                                     step=log.next_step,
                                     op="resize_", phase=log.phase)
        if freed is not None:
            log.freed([freed])
        if index is not None:
            log.step("resize_", [index], [])

    def poll(self) -> None:
        """Record every storage that died since the last poll."""
        self.log.freed(self.table.dead())

    def end_node(self, poll: bool = True) -> None:
        """The current node's ops are done: settle what autograd saved (and, with ``poll``, frees)."""
        self.autograd.bind()
        self.autograd.attribute(set(), None, self._last_op)
        if poll:
            self.poll()

    def _record(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        table, log = self.table, self.log
        # a view op may be autograd replaying a view while it holds that view's autograd mutex
        # (reading its grad_fn after an in-place write through it): no grad_fn is read here then
        if not getattr(func, "is_view", False):
            self.autograd.bind()
        name = tc.op_name(func)
        outs = [t for t in tc.tree_leaves(out) if isinstance(t, torch.Tensor)]
        for t in outs:
            if t.layout != torch.strided:
                raise NotModelled(
                    f"{name} makes a {t.layout} tensor; fxmem models strided (dense) tensors only (a sparse tensor "
                    f"has several storages: indices and values, or crow/col indices and values), so it cannot "
                    f"count this model's memory exactly")
        call = Call(func, args, kwargs, tuple(outs), self.device, torch.is_grad_enabled(), log.phase)
        with self.quiet():  # the probe's own real runs (and its RNG bookkeeping) are not the model's
            kernels.check_call(call, table.env, self._checked)  # a model that cannot run gets no numbers
        program = kernels.hidden_program(call, self.used)
        if not outs and not self.autograd.has_pending and not program:  # e.g. in-place _foreach ops
            return
        # Frees only matter before something is allocated (and at node ends): a view or an in-place
        # op allocates nothing, so it needs no poll.
        if program or any(table.counts(t) and table.lookup(t) is None for t in outs):
            self.poll()
        arg_tensors = call.tensors
        if tc.op_packet(func) not in _LIFT:
            for a in arg_tensors:  # a fake tensor made outside the recorder: treat as a constant
                if table.counts(a) and table.lookup(a) is None:
                    self._unrecorded(a, name)
        reads = tuple(dict.fromkeys(i for a in arg_tensors if table.counts(a) and (i := table.lookup(a)) is not None))
        self.autograd.attribute(set(reads), name, self._last_op)
        reused = kernels.engine_takes_over(call, table, self.autograd.between_nodes, log.node)
        if reused is not None:
            table.take_over(reused, outs[0])
            return
        step = log.next_step
        new = []
        position: dict[int, int] = {}  # output position -> its new storage
        larger = kernels.output_storage(call)  # outputs whose real storage is larger than the fake one
        for k, t in enumerate(outs):
            if table.counts(t) and table.lookup(t) is None:
                index = table.add(t, Role.ACTIVATION, self.buffer_name or log.node, node=log.node, step=step, op=name,
                                  phase=log.phase)
                # an empty fake output holds nothing, unless the real one is larger (oneDNN's LSTM
                # workspace: empty in the fake kernel, megabytes in the real one)
                if index is not None and table.storages[index].bytes == 0 and k not in larger:
                    table.forget(t)
                    continue
                if tc.op_packet(func) in _COPIES and arg_tensors:
                    table.storages[index].copy_of = table.lookup(arg_tensors[0])
                new.append(index)
                position[k] = index
        for i, nbytes in larger.items():
            index = table.lookup(outs[i])
            if index is not None and index in new:  # the real kernel's storage is larger than the fake's
                table.storages[index].bytes = tc.size_expr(table.env, nbytes)
        kept = []
        for keep in [p for p in program if isinstance(p, Keep)]:
            # allocated before the op's outputs and alive until its backward ran: an allocation of
            # this step with no tensor whose death we could see (Autograd releases it)
            index = len(table.storages)
            table.storages.append(Storage(index, sympy.Integer(keep.nbytes), keep.dtype, (), Role.ACTIVATION, log.node,
                                          node=log.node, op=name, step=step, phase=log.phase,
                                          saved_by=[SavedBy(log.node, name)], module=table.module_now()))
            new.append(index)
            kept.append(index)
        if any(isinstance(p, sympy.Basic) and p.has(MeasuredBytes) for p in program):
            log.note_at(f"'{log.node}'", f"{name}'s hidden buffers (oneDNN's reorders and scratch, which change "
                                         f"with the sizes in no pattern a formula states) are measured by one real "
                                         f"run of that kernel alone at each size asked, cached: the ws<k>_up<i> "
                                         f"and ws<k>_down<i> terms of the formulas, functions of its input's dims")
        for unknown in [p for p in program if isinstance(p, Unknown)]:
            log.note_at(f"'{log.node}'", f"{unknown.op} may use workspace fxmem cannot predict ({unknown.why}): "
                                         f"{INEXACT}")
        self.autograd.keep(kept, outs[0] if outs else None)
        program = [p for p in program if not isinstance(p, (Keep, Unknown))
                   and not (isinstance(p, OutAt) and p.index not in position)]  # not new: nothing placed
        if new or program:
            log.step(name, new, [p if p is OUT else Placed(position[p.index]) if isinstance(p, OutAt)
                                 else tc.size_expr(table.env, p) for p in program], reads)
        self._last_op = name
