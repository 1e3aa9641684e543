"""Every string a user gives fxmem is read here, by a parser that cannot execute code or hang.

Dim expressions (``"B"``, ``"H*D"``, ``"N-1"``, ``"(L+1)//2"``) may use names, non-negative integers,
``+ - * //``, parentheses and ``**`` with a small integer exponent; nothing else. Inputs are
bounded (length, nesting, integer size, exponent), so no string makes the process hang, and
names are always the user's dims - never Python's or sympy's (``N``, ``E``, ``S`` and ``I`` mean
dims, not sympy's built-ins). Python's own parser (``ast``) only builds the tree; evaluation is
this module's, over an allowed set of node types.

>>> parse_expression("H*D", {})
D*H
>>> parse_expression("__import__('os').system('x')", {})
Traceback (most recent call last):
...
fxmem.errors.SpecError: expression: '__import__('os').system('x')' may only use dim names, integers, + - * // ** and parentheses (found a function call)
"""
from __future__ import annotations

import ast
import keyword
import math
import re
import unicodedata
from typing import Any, Mapping

import sympy

from .errors import SpecError

MAX_LENGTH = 256  # characters of one expression
MAX_NODES = 200  # syntax-tree nodes of one expression
MAX_INT = 10**15  # the largest integer literal (far above any tensor size)
MAX_EXPONENT = 8  # x**k only for a literal k <= 8
MAX_SIZE = 2**63 - 1  # the largest size or element count torch can index

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_FOUND = {ast.Call: "a function call", ast.Attribute: "an attribute", ast.Subscript: "indexing",
          ast.Lambda: "a lambda", ast.Compare: "a comparison", ast.BoolOp: "a boolean operator",
          ast.Div: "'/' (use '//' for whole numbers)", ast.Mod: "'%'", ast.MatMult: "'@'",
          ast.BitAnd: "'&'", ast.BitOr: "'|'", ast.BitXor: "'^'", ast.LShift: "'<<'", ast.RShift: "'>>'",
          ast.Invert: "'~'", ast.Not: "'not'"}


def dim_symbol(name: str) -> sympy.Symbol:
    """The sympy symbol fxmem uses for the user's dim ``name`` (a positive integer)."""
    return sympy.Symbol(name, integer=True, positive=True)


def dim_name(name: Any) -> Any:
    """A user's dim name as fxmem keys it: NFKC-normalised, as Python normalises identifiers (a
    fullwidth ``Ｂ`` in a spec string is parsed as ``B``, so ``evaluate(Ｂ=3)`` must mean ``B``
    too); anything else unchanged, for the caller's own check."""
    return unicodedata.normalize("NFKC", name) if isinstance(name, str) else name


def check_name(name: Any, where: str) -> str:
    """A dim name: an identifier that is not a Python keyword, NFKC-normalised (:func:`dim_name`)."""
    name = dim_name(name)
    if isinstance(name, str) and keyword.iskeyword(name):
        raise SpecError(f"{where}: {name!r} is a Python keyword, not a dim name; use another name such as "
                        f"'{name}_'")
    if (not isinstance(name, str) or not _NAME.fullmatch(name) or keyword.iskeyword(name) or len(name) > 64
            or name.startswith("__")):
        raise SpecError(f"{where}: {name!r} is not a dim name; use a name such as 'B' or 'seq_len' "
                        f"(letters, digits and '_', not starting with a digit)")
    return name


def parse_expression(text: Any, symbols: dict[str, sympy.Symbol], where: str = "expression",
                     new_names: bool = True) -> sympy.Expr:
    """A dim expression as sympy, over ``symbols`` (name -> symbol).

    With ``new_names`` a name not in ``symbols`` becomes a new dim (added to ``symbols``);
    without, it is an error listing the known dims.
    """
    if not isinstance(text, str):
        raise SpecError(f"{where}: expected a string expression, got {type(text).__name__} {text!r}")
    text = text.strip()
    if not text:
        raise SpecError(f"{where}: the expression is empty; write a dim name such as 'B' or an integer")
    if len(text) > MAX_LENGTH:
        raise SpecError(f"{where}: the expression is {len(text)} characters long; at most {MAX_LENGTH} are read")
    if keyword.iskeyword(dim_name(text)) and dim_name(text) not in ("True", "False", "None"):
        # ('lambda' alone would only be a syntax error below, which does not say why)
        raise SpecError(f"{where}: cannot parse {text!r}: it is a Python keyword, not a dim name; use another "
                        f"name such as '{dim_name(text)}_'")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        raise SpecError(f"{where}: cannot parse {text!r}; write a dim name like 'N' or an expression like 'H*D' "
                        f"or 'N-1'") from None
    nodes = list(ast.walk(tree))
    if len(nodes) > MAX_NODES:
        raise SpecError(f"{where}: {text!r} is too complex ({len(nodes)} parts; at most {MAX_NODES})")
    return sympy.expand(_Evaluate(text, symbols, where, new_names).visit(tree.body))


class _Evaluate(ast.NodeVisitor):
    """Evaluates the allowed nodes; anything else is a clear error."""

    def __init__(self, text: str, symbols: dict, where: str, new_names: bool):
        self.text, self.symbols, self.where, self.new_names = text, symbols, where, new_names

    def fail(self, why: str) -> SpecError:
        return SpecError(f"{self.where}: {self.text!r} {why}")

    def generic_visit(self, node: ast.AST) -> Any:
        found = next((v for k, v in _FOUND.items() if isinstance(node, k)), type(node).__name__)
        raise self.fail(f"may only use dim names, integers, + - * // ** and parentheses (found {found})")

    def visit_Constant(self, node: ast.Constant) -> sympy.Expr:
        if isinstance(node.value, bool) or not isinstance(node.value, int):
            raise self.fail(f"contains {node.value!r}; sizes are whole numbers")
        if node.value > MAX_INT:
            raise self.fail(f"contains the integer {node.value}, larger than any size ({MAX_INT})")
        return sympy.Integer(node.value)

    def visit_Name(self, node: ast.Name) -> sympy.Expr:
        name = check_name(node.id, self.where)
        if name not in self.symbols:
            if not self.new_names:
                known = ", ".join(sorted(self.symbols)) or "none"
                raise self.fail(f"uses {name!r}, which is not a dim of this analysis (its dims: {known})")
            self.symbols[name] = dim_symbol(name)
        return self.symbols[name]

    def visit_UnaryOp(self, node: ast.UnaryOp) -> sympy.Expr:
        if isinstance(node.op, ast.USub):
            return -self.visit(node.operand)
        if isinstance(node.op, ast.UAdd):
            return self.visit(node.operand)
        return self.generic_visit(node.op)

    def visit_BinOp(self, node: ast.BinOp) -> sympy.Expr:
        if isinstance(node.op, ast.Pow):
            exponent = node.right
            if not (isinstance(exponent, ast.Constant) and type(exponent.value) is int
                    and 0 <= exponent.value <= MAX_EXPONENT):
                raise self.fail(f"has an exponent that is not an integer from 0 to {MAX_EXPONENT}")
            base = self.visit(node.left)
            if base.is_number and abs(base) > 1 and exponent.value * math.log2(abs(int(base))) > 60:
                raise self.fail("is larger than any size")
            return base**exponent.value
        a, b = self.visit(node.left), self.visit(node.right)
        if isinstance(node.op, ast.Add):
            return a + b
        if isinstance(node.op, ast.Sub):
            return a - b
        if isinstance(node.op, ast.Mult):
            return a * b
        if isinstance(node.op, ast.FloorDiv):
            if b == 0:
                raise self.fail("divides by zero")
            if b.is_number and b < 0:
                raise self.fail("divides by a negative number")
            return sympy.floor(a / b)
        return self.generic_visit(node.op)


def parse_int(value: Any, where: str, minimum: int = 1) -> int:
    """A whole number >= ``minimum`` (a Python int, or a string of digits); bools and floats refused."""
    if isinstance(value, str) and re.fullmatch(r"\s*-?\d{1,19}\s*", value):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(f"{where}: {value!r} is not a whole number")
    if value < minimum:
        raise SpecError(f"{where}: {value} must be at least {minimum}")
    if value > MAX_SIZE:
        raise SpecError(f"{where}: {value} is larger than any size torch can index ({MAX_SIZE})")
    return value


def parse_assignments(text: Any, what: str, values: str = "int", minimum: int = 1) -> dict[str, Any]:
    """``"B=4,N=500"`` -> ``{"B": 4, "N": 500}`` (``values="int"``), or literal values (``values="literal"``:
    numbers, strings, True/False/None, tuples and lists of them - ``--init dim=512,act='gelu'``)."""
    if not isinstance(text, str):
        raise SpecError(f"{what}: expected NAME=VALUE pairs, got {type(text).__name__}")
    if len(text) > 4 * MAX_LENGTH:
        raise SpecError(f"{what}: {len(text)} characters is too long")
    out: dict[str, Any] = {}
    for item in _split_top_level(text, what):
        name, eq, value = item.partition("=")
        name = name.strip()
        if not eq or not name:
            raise SpecError(f"{what} {text!r}: expected NAME=VALUE pairs separated by commas, e.g. B=4,N=500")
        name = check_name(name, what)
        if name in out:
            raise SpecError(f"{what} {text!r}: {name} is given twice")
        out[name] = (parse_int(value.strip(), f"{what} {name}", minimum) if values == "int"
                     else _literal(value.strip(), what, name))
    return out


def _literal(value: str, what: str, name: str) -> Any:
    try:
        parsed = ast.literal_eval(value)
    except (ValueError, SyntaxError, MemoryError, RecursionError, TypeError):
        if _NAME.fullmatch(value):  # a bare word: a string (--init act=gelu)
            return value
        raise SpecError(f"{what} {name}={value!r}: write a Python literal (a number, 'text', True, None, "
                        f"or a tuple/list of them)") from None
    if isinstance(parsed, (set, dict, bytes, complex)):
        raise SpecError(f"{what} {name}={value!r}: only numbers, strings, True/False/None and tuples/lists are accepted")
    return parsed


def _split_top_level(text: str, what: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in text:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth < 0:
                raise SpecError(f"{what} {text!r}: unbalanced brackets")
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if depth:
        raise SpecError(f"{what} {text!r}: unbalanced brackets")
    if cur.strip():
        parts.append(cur)
    return parts


def normal_names(values: Mapping[Any, Any], what: str) -> dict[Any, Any]:
    """``values`` keyed by :func:`dim_name` (a name given twice, as ``B`` and ``Ｂ``, refused)."""
    out: dict[Any, Any] = {}
    for name, value in values.items():
        key = dim_name(name)
        if key in out:
            raise SpecError(f"{what}: dim {key!r} is given twice ({name!r} is the same name as {key!r})")
        out[key] = value
    return out


def check_sizes(dims: Mapping[str, Any], symbols: Mapping[str, sympy.Symbol], what: str) -> dict[str, int]:
    """Sizes for every dim of an analysis: each a whole number >= 1 (bools, floats, inf refused)."""
    dims = normal_names(dims, f"{what}()")
    unknown = sorted(set(dims) - set(symbols))
    if unknown:
        raise SpecError(f"{what}(): unknown dim(s) {unknown}; this analysis has dims {sorted(symbols)}")
    missing = sorted(set(symbols) - set(dims))
    if missing:
        raise SpecError(f"{what}(): missing dim(s) {missing}; give a size for each of {sorted(symbols)}")
    out = {}
    for name, value in dims.items():
        if isinstance(value, bool):
            raise SpecError(f"{what}(): dim {name}={value!r} is not an integer")
        if not isinstance(value, int):
            try:
                as_int = int(value) if isinstance(value, float) and math.isfinite(value) else None
            except (TypeError, ValueError, OverflowError):
                as_int = None
            if as_int is None:
                try:
                    as_int = int(value) if not isinstance(value, float) else None
                except (TypeError, ValueError, OverflowError):
                    as_int = None
            if as_int is None or as_int != value:
                raise SpecError(f"{what}(): dim {name}={value!r} is not an integer")
            value = as_int
        if value <= 0:
            raise SpecError(f"{what}(): dim {name}={value} must be a positive integer")
        if value > MAX_SIZE:
            raise SpecError(f"{what}(): dim {name}={value} is larger than any size torch can index ({MAX_SIZE})")
        out[name] = value
    return out
