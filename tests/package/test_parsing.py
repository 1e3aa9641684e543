"""The parser every user string goes through (fxmem/parsing.py), tried with arbitrary text: it never
executes anything, never hangs, never raises anything but a SpecError, and reads what it accepts
exactly as arithmetic says."""
from __future__ import annotations

import time

import pytest
import sympy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fxmem
from fxmem.parsing import MAX_SIZE, check_sizes, dim_symbol, parse_assignments, parse_expression, parse_int

FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
NAMES = st.sampled_from(["B", "N", "H", "D", "seq_len", "E", "S", "I", "Q", "pi", "oo", "lambda_"])


@FAST
@given(st.text(max_size=300))
def test_any_text_is_parsed_or_refused_clearly_and_quickly(text):
    start = time.perf_counter()
    try:
        expr = parse_expression(text, {})
    except fxmem.SpecError as e:
        assert "expression" in str(e)
    else:
        assert isinstance(expr, sympy.Expr)
    assert time.perf_counter() - start < 1.0


@FAST
@given(st.text(alphabet="B N 0123456789+-*/()%.,'\"_x", max_size=120))
def test_arithmetic_like_text_never_raises_anything_else(text):
    try:
        parse_expression(text, {})
    except fxmem.SpecError:
        pass


def _trees(depth: int):
    leaf = st.one_of(NAMES.map(lambda n: (n, dim_symbol(n))), st.integers(0, 10**6).map(lambda k: (str(k), sympy.Integer(k))))
    if depth == 0:
        return leaf

    def combine(args):
        op, (ta, ea), (tb, eb) = args
        if op == "+":
            return f"({ta} + {tb})", ea + eb
        if op == "-":
            return f"({ta} - {tb})", ea - eb
        if op == "*":
            return f"({ta}*{tb})", ea * eb
        return f"({ta})**2", ea**2

    return st.one_of(leaf, st.tuples(st.sampled_from("+-*^"), _trees(depth - 1), _trees(depth - 1)).map(combine))


@FAST
@given(_trees(3))
def test_what_it_accepts_means_what_arithmetic_says(tree):
    text, expected = tree
    try:
        parsed = parse_expression(text, {})
    except fxmem.SpecError as e:  # a power of a constant beyond any size is refused, not computed
        assert "larger than any size" in str(e)
        return
    assert sympy.expand(parsed - expected) == 0


@pytest.mark.parametrize("text, why", [
    ("__import__('os').system('touch pwned')", "function call"),
    ("B.__class__", "attribute"),
    ("[B for B in ().__class__.__base__.__subclasses__()]", "ListComp"),
    ("lambda: 1", "lambda"),
    ("B if N else H", "IfExp"),
    ("B / 2", "'/'"),
    ("B % 2", "'%'"),
    ("B @ N", "'@'"),
    ("B < N", "comparison"),
    ("B and N", "boolean"),
    ("not B", "'not'"),
    ("~B", "'~'"),
    ("B[0]", "indexing"),
    ("1.5", "whole numbers"),
    ("'B'", "whole numbers"),
    ("True", "whole numbers"),
    ("9**9**9", "exponent"),
    ("B**N", "exponent"),
    ("2**200", "exponent"),
    ("(2**8)**8", "larger than any size"),
    ("99999**8", "larger than any size"),
    ("10**16", "exponent"),
    ("10000000000000000", "larger than any size"),
    ("B // 0", "divides by zero"),
    ("B // (2 - 2)", "divides by zero"),
    ("B // -2", "negative"),
    ("(" * 300 + "B" + ")" * 300, "characters long"),
    ("B+" * 150 + "B", "characters long"),
    ("", "empty"),
    ("   ", "empty"),
    ("B N", "cannot parse"),
    ("1B", "cannot parse"),
    ("B +", "cannot parse"),
    ("for", "cannot parse"),
    ("B; import os", "cannot parse"),
    ("B\nimport os", "cannot parse"),
])
def test_refused_with_the_reason(text, why):
    with pytest.raises(fxmem.SpecError, match="expression") as info:
        parse_expression(text, {})
    assert why in str(info.value)


def test_names_are_the_users_not_sympys():
    symbols: dict = {}
    expr = parse_expression("E*I + S - N + Q + pi + oo", symbols)
    assert sorted(symbols) == ["E", "I", "N", "Q", "S", "oo", "pi"]
    assert all(s.is_integer and s.is_positive for s in expr.free_symbols)


def test_known_names_only_when_asked():
    with pytest.raises(fxmem.SpecError, match=r"'X'.*not a dim of this analysis \(its dims: B\)"):
        parse_expression("B*X", {"B": dim_symbol("B")}, new_names=False)


@pytest.mark.parametrize("value, ok", [(1, True), ("7", True), (MAX_SIZE, True), (0, False), (-1, False), (True, False),
                                       (2.0, False), ("2.0", False), ("1e3", False), (MAX_SIZE + 1, False),
                                       ("9" * 40, False), (None, False)])
def test_whole_numbers(value, ok):
    if ok:
        assert parse_int(value, "x") == int(value)
    else:
        with pytest.raises(fxmem.SpecError):
            parse_int(value, "x")


@pytest.mark.parametrize("text", ["B=4,N", "=4", "B=4,B=5", "B=x", "B=-1", "B=1.5", "1B=2", "B=4,(N=5", "B=(4", "B=9**9**9"])
def test_bad_assignments(text):
    with pytest.raises(fxmem.SpecError):
        parse_assignments(text, "--dims")


def test_literal_assignments_never_evaluate_code():
    assert parse_assignments("dim=512,act=gelu,shape=(2, 3),bias=False,name='x'", "--init", values="literal") == \
        {"dim": 512, "act": "gelu", "shape": (2, 3), "bias": False, "name": "x"}
    for text in ["x=__import__('os').getcwd()", "x=(1).__class__", "x={1: 2}", "x=b'bytes'", "x=[i for i in ()]"]:
        with pytest.raises(fxmem.SpecError):
            parse_assignments(text, "--init", values="literal")


@FAST
@given(st.dictionaries(st.sampled_from(["B", "N"]), st.one_of(st.integers(-5, 2**70), st.floats(allow_nan=True),
                                                             st.booleans(), st.text(max_size=5), st.none())))
def test_sizes_are_whole_positive_numbers_or_refused(dims):
    symbols = {"B": dim_symbol("B"), "N": dim_symbol("N")}
    try:
        out = check_sizes(dims, symbols, "evaluate")
    except fxmem.SpecError:
        return
    assert set(out) == {"B", "N"} and all(type(v) is int and 1 <= v <= MAX_SIZE for v in out.values())
