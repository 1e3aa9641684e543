"""Run a traced model on fake tensors with symbolic sizes and record every storage it allocates.

This is the measurement behind every formula. The model really runs - real autograd, real
composite decompositions, the GraphModule's own order of frees - only on fake tensors whose sizes
are sympy symbols. A dispatch mode sees each aten op (including the internal copies ``matmul``
makes), a weak reference per storage says exactly when it dies, and autograd's saved-tensor hook
says what is kept for backward. The result is a ledger: storages (with symbolic byte sizes) and
steps (one per allocating aten op), from which :mod:`fxmem.memory_plan` computes live bytes.

>>> rec = simulate(gm, specs, symbols, hints, device="cpu", grad=True)   # doctest: +SKIP
>>> rec.steps[0].op, rec.storages[rec.steps[0].allocs[0]].nbytes          # doctest: +SKIP
('aten.mm', 512*B*N)
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Sequence

import sympy
import torch
import torch.fx

from . import _torch_compat as tc
from . import hidden
from .errors import DeviceError, FxMemError, ShapeError, UnsupportedOpError
from .real_paths import RealPaths
from .training import Training
from .specs import InputSpec
from .tracing import SourceLine, module_path, source_line

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

    def user_map(self) -> dict:
        """ShapeEnv symbol -> user symbol (dims PyTorch specialised to a constant, e.g. 1, have none)."""
        from .specs import dim_symbol

        return {s: dim_symbol(name) for name, s in self.env_symbols.items() if isinstance(s, sympy.Symbol)}


class _Ledger:
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
        self.keeps: dict[str, list[int]] = {}  # fx node -> hidden storages autograd keeps

    def release_keeps(self, node: str) -> None:
        """The backward of ``node`` ran: autograd released what it kept for it."""
        for idx in self.keeps.pop(node, []):
            self.storages[idx].freed = True
            self.events.append(("free", idx))

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
        name = tc.op_name(func)
        outs = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        program = hidden.program_for(func, args, kwargs, tuple(outs), self.device, torch.is_grad_enabled())
        if not outs and not self.pending_packs and not program:  # e.g. in-place _foreach ops
            return
        self.poll()
        arg_tensors = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        if tc.op_packet_name(func) not in _LIFT:
            for a in arg_tensors:  # a fake tensor made outside the recorder: treat as a constant
                if self._counts(a) and self.lookup(a) is None:
                    self.add(a, "constant", f"{self.node}:{name}")
        self._resolve_packs({self.lookup(a) for a in arg_tensors}, name)
        step = len(self.steps)
        if self.engine_gap and self.phase == "backward" and self._accumulates_in_place(func, args, outs):
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

    def end_node(self) -> None:
        self._resolve_packs(set(), None)
        self.poll()


class _Recorder(tc.DispatchMode):
    def __init__(self, ledger: _Ledger):
        super().__init__()
        self.ledger = ledger

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if tc.op_packet_name(func) not in _SKIP:
            self.ledger.record(func, args, kwargs, out)
        return out


class _Phases:
    """The training step after the forward, as pseudo-nodes so tables and replays can show it."""

    def __init__(self, ledger: _Ledger, nodes: list):
        self.ledger = ledger
        self.nodes = nodes

    @contextlib.contextmanager
    def phase(self, name: str) -> Any:
        self.ledger.node = name
        self.ledger.phase = name
        first = len(self.ledger.steps)
        yield
        self.ledger.end_node()
        self.nodes.append(NodeRecord(name, "phase", name, "", None, [], first, len(self.ledger.steps)))
        self.ledger.events.append(("node", len(self.nodes) - 1))


def _attribute_backward(ledger: _Ledger, node_name: str, value: Any, seen: set) -> None:
    """Name the backward of each fx node after it: a pre-hook on the autograd nodes it created."""
    for t in torch.utils._pytree.tree_leaves(value):
        fn = getattr(t, "grad_fn", None) if isinstance(t, torch.Tensor) else None
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))

        def enter(*_: Any, name: str = f"{node_name} (backward)") -> None:
            ledger.node = name

        def leave(*_: Any) -> None:  # the engine releases the node's saved variables right after
            ledger.release_keeps(node_name)

        fn.register_prehook(enter)
        fn.register_hook(leave)


def _watch_engine(loss: torch.Tensor, ledger: _Ledger) -> None:
    """Tell the ledger when the autograd engine is between nodes (where it accumulates grads).

    A post-hook on every node (but AccumulateGrad, whose refcount-based choice to steal the
    gradient a hook would change) sets the flag; a pre-hook on every node clears it.
    """
    seen: set = set()
    stack = [loss.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        stack.extend(nxt for nxt, _ in fn.next_functions)
        if type(fn).__name__ == "AccumulateGrad":
            continue

        def enter(*_: Any) -> None:
            ledger.engine_gap = False

        def leave(*_: Any) -> None:
            ledger.engine_gap = True

        fn.register_prehook(enter)
        fn.register_hook(leave)


def _last_uses(graph: torch.fx.Graph) -> dict:
    """What the GraphModule's generated code sets to None after each node (fx codegen's rule)."""
    seen: set = set()
    after: dict = {}
    for node in reversed(graph.nodes):
        for n in node.all_input_nodes:
            if n not in seen:
                seen.add(n)
                after.setdefault(node, []).append(n)
    for node in graph.nodes:
        if not node.users and node.op not in ("output", "placeholder"):
            after.setdefault(node, []).append(node)
    return after


class _Runner(torch.fx.Interpreter):
    """Interpreter that frees values exactly where the GraphModule's code would."""

    def __init__(self, gm: torch.fx.GraphModule, ledger: _Ledger, specs: Sequence[InputSpec],
                 name_backward: bool = False):
        super().__init__(gm, garbage_collect_values=False)
        self.ledger = ledger
        self.specs = list(specs)
        self.node_records: list[NodeRecord] = []
        self.name_backward = name_backward
        self._grad_fns: set = set()

    real_paths: RealPaths | None = None

    def call_function(self, target: Any, args: tuple, kwargs: dict) -> Any:
        if self.real_paths is not None:
            target = self.real_paths.replacement(target) or target
        return super().call_function(target, args, kwargs)

    def run_graph(self, inputs: list) -> Any:
        self.env = {}
        self.args_iter = iter(inputs)
        after = _last_uses(self.graph)
        result = None
        for node in self.graph.nodes:
            self.ledger.node = node.name
            first = len(self.ledger.steps)
            try:
                value = self.run_node(node)
            except FxMemError:
                raise
            except Exception as exc:
                raise _node_error(node, exc, self) from exc
            self.env[node] = value
            if self.name_backward:
                _attribute_backward(self.ledger, node.name, value, self._grad_fns)
            self.ledger.end_node()
            self.node_records.append(self._describe(node, value, first))
            if node.op == "output":
                result = value
            for n in after.get(node, []):
                self.env.pop(n, None)
            del value
            self.ledger.poll()
            self.node_records[-1].end_step = len(self.ledger.steps)
            self.ledger.events.append(("node", len(self.node_records) - 1))
        self.env.clear()
        return result

    def _describe(self, node: torch.fx.Node, value: Any, first: int) -> NodeRecord:
        outs = []
        for t in torch.utils._pytree.tree_leaves(value):
            if isinstance(t, torch.Tensor):
                shape = tuple(tc.size_expr(self.ledger.env, d) for d in t.shape)
                outs.append((shape, t.dtype, self.ledger.lookup(t) if self.ledger._counts(t) else None))
        plain = None
        if isinstance(value, torch.SymInt) or isinstance(value, int) and not isinstance(value, bool):
            plain = tc.size_expr(self.ledger.env, value)
        target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
        return NodeRecord(node.name, node.op, str(target), module_path(node), source_line(node), outs,
                          first, len(self.ledger.steps), plain)


def _node_error(node: torch.fx.Node, exc: BaseException, runner: _Runner) -> FxMemError:
    src = source_line(node)
    where = f"fx node '{node.name}' ({node.format_node()})" + (f" from {src.file}:{src.line}: {src.code}" if src else "")
    # which inputs flow into this node, so the user knows which spec to look at
    feeding, stack, seen = [], [node], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder":
            feeding.append(str(n.target))
        stack.extend(n.all_input_nodes)
    specs = {s.arg: s for s in runner.specs}
    args_text = ", ".join(f"'{a}' {specs[a].text}" for a in reversed(feeding) if a in specs)
    arg_shapes = []
    for a in node.all_input_nodes:
        v = runner.env.get(a)
        if isinstance(v, torch.Tensor):
            arg_shapes.append(f"{a.name}: {tuple(tc.size_expr(runner.ledger.env, d) for d in v.shape)}")
    shapes_text = ("; operand shapes " + ", ".join(arg_shapes)) if arg_shapes else ""
    text = str(exc)
    if isinstance(exc, tc.UNSUPPORTED_OP_ERRORS) or "fake impl" in text or "'Meta' backend" in text \
            or "meta kernel" in text.lower() or "register_fake" in text:
        op = getattr(exc, "func", None) or node.target
        return UnsupportedOpError(
            f"{where}: op {op} has no meta/fake kernel, so fxmem cannot run it on symbolic shapes "
            f"({type(exc).__name__}: {text.strip().splitlines()[0] if text.strip() else ''}). "
            f"Register one with torch.library.register_fake (it only computes output shapes)."
        )
    if isinstance(exc, tc.DATA_DEPENDENT_ERRORS):
        return UnsupportedOpError(
            f"{where}: the result depends on tensor values ({type(exc).__name__}: {exc}). fxmem gives formulas "
            f"in input sizes; replace value-dependent code (.item(), nonzero, boolean masks) by size-only ops."
        )
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return ShapeError(
        f"{where} fails on the given input shapes{shapes_text}: {reason}\n"
        f"  inputs reaching this node: {args_text or '(none)'}\n"
        f"  what to do: check the rank and sizes of those input specs against what the model expects."
    )


def _fake_tensor_like(t: torch.Tensor, device: str, requires_grad: bool) -> torch.Tensor:
    return torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device=device,
                               requires_grad=requires_grad)


def _fake_module_copy(module: torch.nn.Module, device: str, grad: bool, memo: dict) -> torch.nn.Module:
    """A structural copy of ``module`` whose tensors are fake; the user's module is not touched."""
    if id(module) in memo:
        return memo[id(module)]
    new = object.__new__(type(module))
    memo[id(module)] = new
    new.__dict__.update(module.__dict__)

    def fake(t: torch.Tensor | None, trainable: bool) -> torch.Tensor | None:
        if t is None:
            return None
        key = ("t", id(t))
        if key not in memo:  # shared (tied) tensors stay shared
            memo[key] = _fake_tensor_like(t, device, trainable and t.requires_grad and grad)
        return memo[key]

    new.__dict__["_parameters"] = {k: fake(v, True) for k, v in module._parameters.items()}
    new.__dict__["_buffers"] = {k: fake(v, False) for k, v in module._buffers.items()}
    new.__dict__["_modules"] = {k: (_fake_module_copy(v, device, grad, memo) if v is not None else None)
                                for k, v in module._modules.items()}
    for k, v in list(new.__dict__.items()):
        if isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter):
            new.__dict__[k] = fake(v, False)
    return new


def _check_device(device: str) -> None:
    if device not in ("cpu", "cuda"):
        raise DeviceError(f"device={device!r} is not supported; use 'cpu' or 'cuda'")
    if device == "cuda":
        ok, why = tc.fake_cuda_is_safe()
        if not ok:
            raise DeviceError(
                f"device='cuda' cannot be simulated: {why}. Install a CUDA build of torch (it simulates "
                f"CUDA without a GPU), or analyse with device='cpu'."
            )


def simulate(
    gm: torch.fx.GraphModule,
    specs: Sequence[InputSpec],
    symbols: dict,
    hints: dict,
    device: str = "cpu",
    grad: bool = True,
    training: Training | None = None,
) -> Recording:
    """Run ``gm`` once on fake inputs described by ``specs`` and record its memory behaviour.

    With ``training``, the run is one steady-state training step (see :mod:`fxmem.training`):
    the optimizer's state is created first (quietly, from placeholder gradients), then forward,
    loss, backward, ``optimizer.step()`` and ``zero_grad(set_to_none=True)`` are recorded.
    """
    _check_device(device)
    if training is not None and not grad:
        raise FxMemError("a training step needs grad=True")
    mode, env = tc.new_fake_mode()
    env_symbols = {name: tc.make_dim_symbol(env, name, hints[name]) for name in symbols}
    to_env = {symbols[name]: s for name, s in env_symbols.items()}  # s is a number if specialised
    hint_of = {symbols[name]: hints[name] for name in symbols}
    ledger = _Ledger(env, device)
    with mode:
        inputs = []
        for spec in specs:
            sizes = [tc.make_symint(env, d.xreplace(to_env), int(d.xreplace(hint_of))) for d in spec.dims]
            inputs.append(torch.empty(sizes, dtype=spec.dtype, device=device,
                                      requires_grad=spec.requires_grad and grad))
        memo: dict = {}
        fake_gm = _fake_module_copy(gm, device, grad, memo)
        for spec, t in zip(specs, inputs):
            ledger.add(t, "input", spec.arg)
        named_params = list(fake_gm.named_parameters(remove_duplicate=True))
        for qual, p in named_params:
            ledger.add(p, "parameter", qual)
        for qual, b in fake_gm.named_buffers(remove_duplicate=True):
            ledger.add(b, "buffer", qual)
        for mod_name, m in fake_gm.named_modules():
            for k, v in m.__dict__.items():
                if isinstance(v, torch.Tensor):
                    ledger.add(v, "constant", f"{mod_name}.{k}" if mod_name else k)
        runner = _Runner(fake_gm, ledger, specs, name_backward=training is not None)
        grad_ctx = contextlib.nullcontext() if grad else torch.no_grad()
        hooks = tc.saved_tensor_hooks(ledger.mark_saved) if grad else contextlib.nullcontext()
        optimizer_ctx = tc.optimizers_treat_fake_as_real() if training else contextlib.nullcontext()
        real_paths = RealPaths(device, ledger.quiet, ledger.note)
        runner.real_paths = real_paths
        with grad_ctx, hooks, optimizer_ctx, real_paths, _Recorder(ledger):
            optimizer = _steady_state_optimizer(training, named_params, ledger) if training else None
            out = runner.run_graph(inputs)
            ledger.end_node()
            for t in torch.utils._pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor) and ledger._counts(t):
                    idx = ledger.lookup(t)
                    if idx is not None:
                        ledger.storages[idx].is_output = True
            ledger.poll()
            forward_end = len(ledger.events)
            if training is not None:
                phases = _Phases(ledger, runner.node_records)
                with phase_errors("the loss"), phases.phase("loss"):
                    loss = training.loss_fn(out)
                _watch_engine(loss, ledger)
                with phase_errors("backward()"), phases.phase("backward"):
                    loss.backward()
                    for _, p in named_params:
                        idx = ledger.lookup(p.grad) if p.grad is not None and ledger._counts(p.grad) else None
                        if idx is not None:
                            ledger.storages[idx].role = "gradient"
                with phase_errors("optimizer.step()"), phases.phase("optimizer.step"):
                    optimizer.step()
                with phases.phase("zero_grad"):
                    optimizer.zero_grad(set_to_none=True)
                with phases.phase("return"):  # the step's locals (output, loss) die here
                    del loss, out
                    for t in inputs:
                        t.grad = None
                out = None
        del out, inputs, fake_gm, runner.env
    return Recording(ledger.storages, ledger.steps, runner.node_records, ledger.events, ledger.notes, env,
                     env_symbols, device, forward_end, training is not None)


def _steady_state_optimizer(training: Training, named_params: list, ledger: _Ledger) -> torch.optim.Optimizer:
    """Build the optimizer and let it create its state (as after a first step), quietly."""
    params = [p for _, p in named_params if p.requires_grad]
    if not params:
        raise FxMemError("no parameter requires grad, so there is nothing to train")
    with ledger.quiet(), phase_errors("creating the optimizer's state"):
        optimizer = training.make_optimizer(params)  # some (Adagrad) create state here already
        for p in params:
            p.grad = torch.zeros_like(p)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    name_of = {id(p): qual for qual, p in named_params}
    for p, state in optimizer.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                idx = ledger.add(value, "optimizer_state", f"{name_of.get(id(p), '?')}.{key}")
                if idx is not None:
                    ledger.storages[idx].role = "optimizer_state"
    return optimizer


@contextlib.contextmanager
def phase_errors(what: str) -> Any:
    """Errors raised by the training step's phases, named after the phase."""
    try:
        yield
    except FxMemError:
        raise
    except Exception as exc:
        raise ShapeError(f"{what} failed on fake tensors: {type(exc).__name__}: {exc}") from exc
