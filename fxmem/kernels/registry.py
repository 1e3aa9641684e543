"""The registry of kernel knowledge: what real kernels do that fake (meta) kernels do not.

A fake kernel allocates exactly the op's outputs, with the strides its meta function says. A real
kernel may do more through the same allocator, and fxmem must know it to be exact. Every such fact
is one :class:`Rule`, registered once, keyed by the op's *object* (``torch.ops.aten.repeat.default``
or the packet ``torch.ops.aten.repeat``; a Python function such as ``F.linear`` for
:data:`Kind.REAL_PATH`), so a renamed or removed op fails at import instead of silently no longer
matching. Each rule states the torch versions it was checked against real runs on
(``tests/kernels/test_kernels.py`` re-checks them on every version CI runs).

Kinds of knowledge (:class:`Kind`):

* ``HIDDEN`` - scratch a kernel allocates and frees (or keeps for backward) around its outputs,
  as a *program*: signed byte deltas in order, with :data:`OUT` where the outputs appear;
* ``OUTPUT_STORAGE`` - outputs whose real storage is larger than the fake one;
* ``ENGINE`` - the autograd engine reusing a buffer in place where fake tensors get a new one;
* ``REAL_PATH`` - a composite that takes another code path for real tensors than for fake ones;
* ``OUTPUT_LAYOUT`` - outputs the real kernel lays out otherwise than the fake one (contiguous where
  the fake kernel follows a strided input): ``fn(call) -> {output index: torch.memory_format}``;
* ``SYMBOLIC`` - the op computed on fake tensors without reading sizes as numbers, where its
  fake kernel does (``int(size)`` fixes the user's dim for good: formulas would hold at one size).

Users describe their own ops' allocations the same way (flop_counter's ``custom_mapping`` is the
precedent), for one analysis (``fxmem.analyze(..., kernels={op: fn})``) or for the process
(:func:`register`):

>>> def fused_scratch(call):                        # a 4-byte-per-element workspace, freed on return
...     x = call.arg("x")
...     return [x.numel() * 4, OUT, -x.numel() * 4]
>>> register(torch.ops.mylib.fused.default, fused_scratch)          # doctest: +SKIP
"""
from __future__ import annotations

import contextlib
import dataclasses
import enum
from typing import Any, Callable, Iterator, Mapping

import sympy
import torch

from .. import _torch_compat as tc
from ..errors import SpecError
from ..records import Phase


class _Out:
    """Where a program's op outputs appear (one object; compare with ``is``)."""

    _instance: "_Out | None" = None

    def __new__(cls) -> "_Out":
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "OUT"

    def __reduce__(self) -> str:
        return "OUT"


OUT = _Out()


@dataclasses.dataclass(frozen=True)
class OutAt:
    """Where one output (``index``: its position among the op's tensor outputs) appears in a program,
    when the kernel allocates its outputs at different moments (convolution_backward allocates
    grad_input before its scratch, grad_weight after it). Outputs without one appear at ``OUT``."""

    index: int

# The torch releases CI checks every built-in rule against (tests/kernels/test_kernels.py, both phases).
CHECKED = ("2.13", "2.14")


@dataclasses.dataclass(frozen=True)
class Keep:
    """A hidden allocation that outlives the op: autograd keeps it for backward.

    Autograd saves a wrapped Python number (``x * 0.125`` saves the 0-dim tensor of ``0.125``)
    without calling saved-tensor hooks, so it cannot be seen being saved; the rule says so instead.
    """

    nbytes: int
    dtype: torch.dtype
    why: str


@dataclasses.dataclass(frozen=True)
class Unknown:
    """A rule's admission that it cannot describe this call's hidden allocations."""

    op: str
    why: str


@dataclasses.dataclass
class Call:
    """One aten call as a rule sees it. ``arg(name)`` reads an argument by its schema name."""

    func: Any
    args: tuple
    kwargs: dict
    outputs: tuple  # tensor outputs, in order
    device: str
    grad_enabled: bool = False
    phase: Phase = Phase.FORWARD
    _bound: dict | None = dataclasses.field(default=None, repr=False)

    @property
    def bound(self) -> dict:
        """Arguments by schema name (defaults filled in)."""
        if self._bound is None:
            self._bound = tc.bind_arguments(self.func, self.args, self.kwargs)
        return self._bound

    def arg(self, name: str, default: Any = None) -> Any:
        return self.bound.get(name, default)

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [a for a in tc.tree_leaves((self.args, self.kwargs)) if isinstance(a, torch.Tensor)]

    @property
    def op(self) -> str:
        return tc.op_name(self.func)


class Kind(str, enum.Enum):
    HIDDEN = "hidden"
    OUTPUT_STORAGE = "output_storage"
    ENGINE = "engine"
    REAL_PATH = "real_path"
    SYMBOLIC = "symbolic"
    OUTPUT_LAYOUT = "output_layout"


ANY = "any"  # device key of rules that hold on every device


@dataclasses.dataclass(frozen=True)
class Rule:
    """One fact about a real kernel: ``fn`` for calls of ``key`` on ``device``."""

    key: Any  # OpOverload, OpOverloadPacket, or a Python function (REAL_PATH)
    kind: Kind
    device: str
    fn: Callable
    verified: tuple = CHECKED  # torch "major.minor" releases checked against real runs
    user: bool = False  # described by the user (not checked by fxmem's tests)

    @property
    def name(self) -> str:
        key = self.key
        if tc.is_op(key):
            return tc.op_name(key)
        return getattr(key, "__qualname__", None) or getattr(key, "__name__", repr(key))

    @property
    def why(self) -> str:
        return (self.fn.__doc__ or "").strip().split("\n")[0]


class Registry:
    """Rules by (kind, key, device); an overload's own rule wins over its packet's."""

    def __init__(self) -> None:
        self._rules: dict[tuple, Rule] = {}
        self._scoped: list[dict[tuple, Rule]] = []

    def add(self, rule: Rule) -> Rule:
        key = (rule.kind, rule.key, rule.device)
        if key in self._rules:
            raise ValueError(f"a {rule.kind.value} rule for {rule.name} on {rule.device} is already registered")
        self._rules[key] = rule
        return rule

    def remove(self, rule: Rule) -> None:
        self._rules.pop((rule.kind, rule.key, rule.device), None)

    def lookup(self, kind: Kind, func: Any, device: str) -> Rule | None:
        """The rule for ``func`` (an overload, then its packet) on ``device`` (then on any device)."""
        keys = [func]
        packet = getattr(func, "overloadpacket", None)
        if packet is not None:
            keys.append(packet)
        tables = [*reversed(self._scoped), self._rules]
        for table in tables:
            for k in keys:
                for d in (device, ANY):
                    hit = table.get((kind, k, d))
                    if hit is not None:
                        return hit
        return None

    def rules(self, kind: Kind | None = None) -> list[Rule]:
        """Every registered rule (of ``kind``), built-in and the user's."""
        out = [r for table in (*self._scoped, self._rules) for r in table.values()]
        return [r for r in out if kind is None or r.kind == kind]

    @contextlib.contextmanager
    def scoped(self, mapping: Mapping[Any, Callable] | None, device: str) -> Iterator[None]:
        """Rules of one analysis (``analyze(..., kernels=...)``): HIDDEN programs of the user's ops."""
        table = {}
        for key, fn in (mapping or {}).items():
            _check_user_rule(key, fn, "kernels")
            table[(Kind.HIDDEN, key, device)] = Rule(key, Kind.HIDDEN, device, _checked_program(fn), (), user=True)
        self._scoped.append(table)
        try:
            yield
        finally:
            self._scoped.pop()


REGISTRY = Registry()


def rule(kind: Kind, *keys: Any, device: str, verified: tuple = CHECKED) -> Callable[[Callable], Callable]:
    """Register the decorated function as the ``kind`` rule of each op in ``keys`` on ``device``."""

    def decorate(fn: Callable) -> Callable:
        for key in keys:
            REGISTRY.add(Rule(key, kind, device, fn, tuple(verified)))
        return fn

    return decorate


def hidden(*keys: Any, device: str, verified: tuple = CHECKED) -> Callable[[Callable], Callable]:
    """Register a hidden-allocation program: ``fn(call) -> program | Unknown | None``."""
    return rule(Kind.HIDDEN, *keys, device=device, verified=verified)


def require_args(op: Any, *names: str) -> None:
    """Fail at import when ``op``'s schema lacks an argument a rule reads by name: a schema change
    in a new torch must break here, not silently in a user's numbers."""
    have = tc.argument_names(op)
    missing = [n for n in names if n not in have]
    if missing:
        raise ImportError(f"fxmem.kernels: {tc.op_name(op)} has no argument(s) {missing} in torch "
                          f"{torch.__version__} (its schema: {have}); update the rule that reads them")


def register(op: Any, fn: Callable[[Call], list | None], device: str = "cpu") -> Rule:
    """Describe the allocations a custom op's real kernel makes beyond its outputs, for every analysis.

    ``fn(call)`` returns a program: byte counts allocated (positive) and freed (negative) in order,
    with :data:`OUT` where the op's outputs appear; it must free what it allocates (``Keep(...)``
    entries are kept until the op's backward). Return None when the kernel allocates nothing more.
    ``call.arg("name")`` reads an argument by its schema name; sizes may be symbolic (use them in
    arithmetic, never in ``if``). Returns the rule; ``unregister(rule)`` removes it.
    """
    _check_user_rule(op, fn, "register")
    return REGISTRY.add(Rule(op, Kind.HIDDEN, device, _checked_program(fn), (), user=True))


def unregister(rule: Rule) -> None:
    """Remove a rule added by :func:`register`."""
    REGISTRY.remove(rule)


def _check_user_rule(op: Any, fn: Any, where: str) -> None:
    if not tc.is_op(op):
        raise SpecError(f"{where}: {op!r} is not a torch op; pass an op object such as torch.ops.mylib.fused.default")
    if not callable(fn):
        raise SpecError(f"{where}: the rule for {tc.op_name(op)} must be a function of the call, got {type(fn).__name__}")


def _checked_program(fn: Callable) -> Callable:
    """Wrap a user's program function: a program must be a list with one OUT that frees what it allocates."""

    def checked(call: Call) -> Any:
        program = fn(call)
        if program is None or isinstance(program, Unknown):
            return program
        if not isinstance(program, (list, tuple)) or sum(p is OUT for p in program) != 1:
            raise SpecError(f"the kernel rule for {call.op} returned {program!r}; return a list of byte deltas "
                            f"with exactly one fxmem.kernels.OUT where the outputs appear (or None)")
        net = sum(p for p in program if p is not OUT and not isinstance(p, Keep))
        if sympy.expand(net) != 0:
            raise SpecError(f"the kernel rule for {call.op} does not free what it allocates (net {net} bytes); "
                            f"every positive delta needs its negative (use Keep(...) for what backward keeps)")
        return list(program)

    checked.__doc__ = fn.__doc__ or f"described by the user ({getattr(fn, '__name__', 'a function')})"
    return checked
