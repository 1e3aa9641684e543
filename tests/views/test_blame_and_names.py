"""Errors name who raised them, and a user's dim names are only ever their dims.

* The frame that raised decides the words: the user's own forward, optimizer factory, loss or
  ``step=`` function raising is a :class:`fxmem.UserCodeError` (a ModelError) that says so, with
  the user's file:line - never a ShapeError (which blames the input specs) nor an InternalError
  ("this is not your input").
* Raw exceptions of validate (sizes too large to allocate), from_config (sizes that are not
  positive) and generation (new_tokens of the wrong type) are FxMemErrors naming the argument.
* Names sympy reads as constants (``oo``, ``nan``, ``I``, ``E``, ``pi``, ``S``, ``N`` ...) are plain
  dims everywhere; a fullwidth ``Ｂ`` means ``B`` in a spec and in evaluate alike.
* A TorchDynamo capture leaves nothing behind that prints at interpreter exit.
"""
from __future__ import annotations

import inspect
import os
import subprocess
import importlib
import sys
import textwrap

import pytest
import torch
import torch.nn as nn

import fxmem
from fxmem.errors import InternalError, ModelError, ShapeError, SpecError, UserCodeError

HERE = os.path.basename(__file__)
SGD = lambda p: torch.optim.SGD(p, lr=0.1)  # noqa: E731


def _line_of(fn, text: str) -> str:
    """``test_blame_and_names.py:N``: the line of ``fn``'s source holding ``text``."""
    lines, first = inspect.getsourcelines(fn)
    return f"{HERE}:{first + next(i for i, line in enumerate(lines) if text in line)}"


def _blames_the_user(exc: BaseException, party: str, where: str, message: str) -> str:
    text = str(exc)
    assert isinstance(exc, UserCodeError) and isinstance(exc, ModelError), (type(exc), text)
    assert not isinstance(exc, (ShapeError, InternalError)), text
    assert exc.party == party, (exc.party, text)
    assert f"your {party} raised" in text and where in text and message in text, text
    assert "this is not your input" not in text and "fails on the given input shapes" not in text, text
    assert "check the rank and sizes" not in text, text
    return text


# ---------------------------------------------------------------- A: the party that raised


class RaisesItself(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        if x.dim() == 2:
            raise ValueError("this model takes 3-d inputs")
        return self.fc(x)


def _helper_that_raises(x):
    raise KeyError("no such feature")


class RaisesInAHelper(nn.Module):
    def forward(self, x):
        return _helper_that_raises(x)


@pytest.mark.parametrize("mode", ["auto", "eager"])
def test_a_forward_that_raises_is_the_user_s_forward(mode):
    with pytest.raises(UserCodeError) as info:
        fxmem.analyze(RaisesItself(), ("B", 8), mode=mode)
    _blames_the_user(info.value, "forward", _line_of(RaisesItself.forward, "raise ValueError"),
                     "ValueError at")


def test_the_raising_line_is_the_innermost_user_frame():
    with pytest.raises(UserCodeError) as info:
        fxmem.analyze(RaisesInAHelper(), ("B", 8), mode="eager")
    _blames_the_user(info.value, "forward", _line_of(_helper_that_raises, "raise KeyError"), "no such feature")


class EvenOnly(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        if x.shape[0] % 2:
            raise ValueError("the batch must be even")
        return self.fc(x)


def test_a_forward_s_own_size_check_still_tries_other_example_sizes():
    report = fxmem.analyze(EvenOnly(), ("B", 8), mode="eager")  # B=97 is odd; the next example size is not
    assert report.evaluate(B=4)["peak"] > 0
    assert "the batch must be even" in report.notes[0]


def _factory_that_raises(params):
    raise RuntimeError("no optimizer configured")


def test_an_optimizer_factory_that_raises_is_named():
    with pytest.raises(UserCodeError) as info:
        fxmem.analyze(nn.Linear(8, 8), ("B", 8), optimizer=_factory_that_raises)
    text = _blames_the_user(info.value, "optimizer factory", _line_of(_factory_that_raises, "raise RuntimeError"),
                            "no optimizer configured")
    assert "example sizes tried" not in text  # a factory never sees the sizes: no retry at others


def test_an_optimizer_factory_whose_torch_call_refuses_is_the_factory():
    # torch.optim raises inside torch: the innermost user frame is the lambda, the factory
    with pytest.raises(UserCodeError) as info:
        fxmem.analyze(nn.Linear(8, 8), ("B", 8), optimizer=lambda p: torch.optim.SGD(p, lr=-1.0))
    _blames_the_user(info.value, "optimizer factory", HERE, "Invalid learning rate")


def _loss_that_raises(out):
    raise KeyError("logits")


def test_a_loss_that_raises_is_named():
    with pytest.raises(UserCodeError) as info:
        fxmem.analyze(nn.Linear(8, 8), ("B", 8), optimizer=SGD, loss=_loss_that_raises)
    _blames_the_user(info.value, "loss", _line_of(_loss_that_raises, "raise KeyError"), "'logits'")


def _step_of_one_argument(model):
    return model


def test_a_step_with_the_wrong_signature_is_the_user_s_step():
    with pytest.raises(UserCodeError) as info:
        fxmem.analyze(nn.Linear(8, 8), ("B", 8), optimizer=SGD, step=_step_of_one_argument)
    text = str(info.value)
    assert info.value.party == "step= function"
    assert "your step= function _step_of_one_argument" in text and _line_of(_step_of_one_argument, "def ") in text
    assert "takes 1 positional argument but 3 were given" in text and "step(model, optimizer, *inputs)" in text
    assert "this is not your input" not in text and "library code" not in text


def test_a_loss_with_the_wrong_signature_is_the_user_s_loss():
    with pytest.raises(UserCodeError) as info:
        fxmem.analyze(nn.Linear(8, 8), ("B", 8), optimizer=SGD, loss=lambda out, target: out.sum())
    assert info.value.party == "loss" and "missing 1 required positional argument" in str(info.value)


def _step_that_raises(model, optimizer, x):
    model(x).sum().backward()
    raise ValueError("step gave up")


def _step_calling_a_raising_forward(model, optimizer, x):
    model(x).sum().backward()


def test_a_step_that_raises_and_a_forward_raising_inside_a_step():
    with pytest.raises(UserCodeError) as info:
        fxmem.analyze(nn.Linear(8, 8), ("B", 8), optimizer=SGD, step=_step_that_raises)
    _blames_the_user(info.value, "step= function", _line_of(_step_that_raises, "raise ValueError"), "step gave up")
    with pytest.raises(UserCodeError) as info:
        fxmem.analyze(RaisesItself(), ("B", 8), optimizer=SGD, step=_step_calling_a_raising_forward, mode="eager")
    _blames_the_user(info.value, "forward", _line_of(RaisesItself.forward, "raise ValueError"), "3-d inputs")


def test_a_shape_mismatch_inside_torch_still_blames_the_specs():
    with pytest.raises(ShapeError) as info:
        fxmem.analyze(nn.Linear(6, 4), ("B", 5))
    assert "your forward raised" not in str(info.value)


# ---------------------------------------------------------------- B: raw exceptions, named


def test_validate_at_sizes_too_large_to_allocate_names_dims():
    with pytest.raises(SpecError) as info:
        fxmem.validate(nn.Linear(8, 8), ("B", 8), dims={"B": 10**12}, device="cpu")
    text = str(info.value)
    assert "validate(dims=dict(B=1000000000000))" in text and "bytes" in text and "more than this machine" in text
    assert "smaller dims=" in text and "DefaultCPUAllocator" not in text


def test_validate_s_allocation_failure_is_named_too(monkeypatch):
    # the machine has less free than it reports: the allocator's own failure, in the same words
    validation = importlib.import_module("fxmem.validate")  # (fxmem.validate is the function)

    def no_memory(*args, **kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(validation, "random_inputs", no_memory)
    with pytest.raises(SpecError) as info:
        fxmem.validate(nn.Linear(8, 8), ("B", 8), dims={"B": 3}, device="cpu")
    assert "validate(dims=dict(B=3))" in str(info.value) and "more than this machine can allocate" in str(info.value)


LLAMA = {"model_type": "llama", "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
         "intermediate_size": 32, "vocab_size": 32}


@pytest.mark.parametrize("key, value", [("hidden_size", -64), ("hidden_size", 0), ("num_hidden_layers", -1),
                                        ("vocab_size", 0), ("intermediate_size", -5)])
def test_from_config_refuses_sizes_that_are_not_positive(key, value):
    pytest.importorskip("transformers")
    with pytest.raises(SpecError) as info:
        fxmem.from_config({**LLAMA, key: value})
    text = str(info.value)
    assert f"{key}={value}" in text and "positive int" in text and "negative dimension" not in text


def test_from_config_names_the_config_s_own_key_and_its_invalid_values():
    pytest.importorskip("transformers")
    with pytest.raises(SpecError, match="n_embd=-32 must be a positive int"):
        fxmem.from_config({"model_type": "gpt2", "n_embd": -32, "n_layer": 1, "n_head": 2})
    with pytest.raises(SpecError, match="not valid for model_type 'llama'.*multiple of the number of attention heads"):
        fxmem.from_config({**LLAMA, "num_attention_heads": 5})
    with pytest.raises(SpecError, match="does not know model_type 'no_such_model'"):
        fxmem.from_config({"model_type": "no_such_model"})


@pytest.mark.parametrize("new_tokens", [fxmem.TensorSpec(("T",)), 2.5, None, [4], "3", True])
def test_generation_names_new_tokens(new_tokens):
    pytest.importorskip("transformers")
    model = fxmem.from_config(LLAMA)
    with pytest.raises(SpecError) as info:
        fxmem.generation(model, ("B", "P"), new_tokens=new_tokens)
    assert "new_tokens=" in str(info.value) and "positive int" in str(info.value)


def test_from_config_prints_no_deprecation(capfd):
    pytest.importorskip("transformers")
    fxmem.from_config({**LLAMA, "torch_dtype": "bfloat16"})
    assert "deprecated" not in capfd.readouterr().err


# ---------------------------------------------------------------- C: the user's names are dims


class TwoDims(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 16)

    def forward(self, x):
        return torch.relu(self.fc(x)).transpose(0, 1).contiguous()


@pytest.fixture(scope="module")
def reference():
    """The same model with dims named B and N: what every other spelling must give."""
    report = fxmem.analyze(TwoDims(), ("B", "N", 6), optimizer=SGD)
    return {k: v for k, v in report.evaluate(B=3, N=5).items()}


@pytest.mark.parametrize("first, second", [("oo", "nan"), ("I", "E"), ("pi", "S"), ("N", "Q"), ("O", "zoo"),
                                           ("beta", "gamma")])
def test_names_sympy_reads_as_constants_are_the_user_s_dims(first, second, reference):
    report = fxmem.analyze(TwoDims(), (first, second, 6), optimizer=SGD, hints={first: 4})
    assert sorted(report.symbols) == sorted([first, second])
    assert report.evaluate(**{first: 3, second: 5}) == reference
    assert first in str(report.peak) and second in str(report.peak)
    summary = report.summary({first: 3, second: 5})
    assert "input(x)" not in summary and f"({first}, {second}, 6)" in summary
    assert report.peak.is_finite is not False and not report.peak.has(*__import__("sympy").S.ComplexInfinity.atoms())
    assert report.at(f"{first}*{second}", **{first: 3, second: 5}) == 15


def test_a_python_keyword_is_refused_as_a_dim_name_with_its_reason():
    with pytest.raises(SpecError, match="'lambda': it is a Python keyword, not a dim name"):
        fxmem.analyze(TwoDims(), ("lambda", "N", 6))


def test_a_fullwidth_name_means_the_same_dim_in_specs_evaluate_and_hints(reference):
    report = fxmem.analyze(TwoDims(), ("Ｂ", "N", 6), optimizer=SGD, hints={"Ｂ": 4})
    assert sorted(report.symbols) == ["B", "N"]
    assert report.evaluate(**{"Ｂ": 3, "N": 5}) == reference == report.evaluate(B=3, N=5)
    with pytest.raises(SpecError, match="given twice"):
        report.evaluate(**{"Ｂ": 3, "B": 3, "N": 5})


def test_cli_dims_names_are_dims_too():
    from fxmem.parsing import parse_assignments

    assert parse_assignments("oo=3,nan=5,I=2,Ｂ=4", "--dims") == {"oo": 3, "nan": 5, "I": 2, "B": 4}


def test_formula_text_of_a_string_keeps_names_and_functions():
    from fxmem.views.text import formula_text

    assert formula_text("Max(2*oo, floor(N/2)) + E*S") == "E·S + Max(2·oo, floor(N/2))"


# ---------------------------------------------------------------- interpreter exit after a Dynamo capture


_CAPTURE = textwrap.dedent("""
    import gc, sys, torch, fxmem
    class Asserts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(8, 8)
        def forward(self, x):
            assert x.shape[1] == 8   # torch.fx cannot trace this: optimize captures it with TorchDynamo
            return self.fc(x).relu()
    graph = fxmem.optimize(Asserts(), ("B", 8))
    print(fxmem.analyze(graph, ("B", 8)).peak)
    if sys.argv[1] == "teardown":  # what interpreter exit does to the module Dynamo wrote its globals in
        import fxmem.capture.whole_graph as module
        vars(module).clear()
        del graph
        gc.collect()
""")


@pytest.mark.parametrize("how", ["exit", "teardown"])
def test_no_exception_ignored_at_exit_after_a_dynamo_capture(how, tmp_path):
    script = tmp_path / "capture.py"
    script.write_text(_CAPTURE)
    out = subprocess.run([sys.executable, str(script), how], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "B" in out.stdout
    assert "Exception ignored" not in out.stderr and "__builtins_dict__" not in out.stderr, out.stderr[-2000:]
