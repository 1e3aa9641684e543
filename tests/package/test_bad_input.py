"""Bad input through the API, as an adversarial user would give it. Each case asserts its class of
outcome: a clear FxMemError (of the right kind, naming the argument, in the user's dim names, never
torch's internal ``s41``), or an exact result (checked against a real run). Nothing executes a
user's string, hangs, or escapes as a raw exception."""
from __future__ import annotations

import os
import re
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn

import fxmem
from conftest import check_against_real_run

INTERNAL = re.compile(r"\b[su]\d+\b")  # torch's size symbols


class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        y = self.lin(x)
        return y * mask if mask is not None else y


class KeywordOnly(nn.Module):
    def forward(self, *, x):
        return x * 2


class VarArgs(nn.Module):
    def forward(self, *xs):
        return xs[0] * 2


def lin() -> nn.Module:
    return nn.Linear(6, 4)


def analyze(*specs: Any, **kw: Any) -> Callable[[], Any]:
    return lambda: fxmem.analyze(lin(), *specs, **kw)


@pytest.fixture(scope="module")
def report() -> fxmem.Report:
    return fxmem.analyze(lin(), ("B", 6), optimizer=lambda p: torch.optim.SGD(p, lr=0.1))


SGD = lambda p: torch.optim.SGD(p, lr=0.1)  # noqa: E731

# (what is wrong, the call, the error class, fragments its message must contain)
API = [
    # --- input specs: dims
    ("dim code", analyze(("__import__('os').system('touch pwned')", 6)), fxmem.SpecError, ["function call", "'input'"]),
    ("dim attribute", analyze(("B.real", 6)), fxmem.SpecError, ["attribute"]),
    ("dim power tower", analyze(("9**9**9", 6)), fxmem.SpecError, ["exponent"]),
    ("dim huge power", analyze(("(2**8)**8", 6)), fxmem.SpecError, ["larger than any size"]),
    ("dim huge literal", analyze((10**20, 6)), fxmem.SpecError, ["larger than any size"]),
    ("dim divide by zero", analyze(("B//0", 6)), fxmem.SpecError, ["divides by zero"]),
    ("dim true division", analyze(("B/2", 6)), fxmem.SpecError, ["'/'"]),
    ("dim negative", analyze(("-B", 6)), fxmem.SpecError, ["negative for every size"]),
    ("dim negative int", analyze((-3, 6)), fxmem.SpecError, ["negative"]),
    ("dim negative constant", analyze(("2-5", 6)), fxmem.SpecError, ["negative"]),
    ("dim float", analyze((2.5, 6)), fxmem.SpecError, ["neither an int nor a dim name"]),
    ("dim bool", analyze((True, 6)), fxmem.SpecError, ["neither an int nor a dim name"]),
    ("dim None", analyze((None, 6)), fxmem.SpecError, ["neither an int nor a dim name"]),
    ("dim list", analyze((["B"], 6)), fxmem.SpecError, ["neither an int nor a dim name"]),
    ("dim empty", analyze(("", 6)), fxmem.SpecError, ["empty"]),
    ("dim keyword", analyze(("lambda", 6)), fxmem.SpecError, ["cannot parse"]),
    ("dim two words", analyze(("B N", 6)), fxmem.SpecError, ["cannot parse"]),
    ("dim too long", analyze(("B" + "+B" * 200, 6)), fxmem.SpecError, ["characters long"]),
    ("dim comparison", analyze(("B>1", 6)), fxmem.SpecError, ["comparison"]),
    ("dim modulo", analyze(("B%2", 6)), fxmem.SpecError, ["'%'"]),
    ("dim unicode name", analyze(("Bé", 6)), fxmem.SpecError, ["is not a dim name"]),
    ("dim dunder", analyze(("__class__", 6)), fxmem.SpecError, ["is not a dim name"]),
    ("negative at the hints", analyze(("N-200", 6)), fxmem.SpecError, ["is -103 at N=97", "hints="]),
    ("too large at the hints", analyze(("B", 6), hints={"B": 2**62}), fxmem.SpecError, ["more bytes than torch"]),
    # --- input specs: the rest
    ("spec is a string", analyze("B,6"), fxmem.SpecError, ["tuple of dims"]),
    ("spec is an int", analyze(6), fxmem.SpecError, ["tuple of dims"]),
    ("spec is a dict", analyze({"B": 6}), fxmem.SpecError, ["tuple of dims"]),
    ("spec is None", analyze(None), fxmem.SpecError, ["tuple of dims"]),
    ("TensorSpec of a string", lambda: fxmem.TensorSpec("B"), fxmem.SpecError, ["tuple of ints and dim names"]),
    ("TensorSpec of an int", lambda: fxmem.TensorSpec(6), fxmem.SpecError, ["tuple of ints and dim names"]),
    ("dtype a string", analyze(fxmem.TensorSpec(("B", 6), dtype="float32")), fxmem.SpecError, ["torch.dtype"]),
    ("dtype quantized", analyze(fxmem.TensorSpec(("B", 6), dtype=torch.qint8)), fxmem.SpecError, ["quantized"]),
    ("dtype quint8", analyze(fxmem.TensorSpec(("B", 6), dtype=torch.quint8)), fxmem.SpecError, ["quantized"]),
    ("quantized tensor", lambda: fxmem.analyze(lin(), torch.quantize_per_tensor(torch.randn(2, 6), 0.1, 0, torch.qint8)),
     fxmem.SpecError, ["quantized"]),
    ("int input requires grad", analyze(fxmem.TensorSpec(("B", 6), dtype=torch.int64, requires_grad=True)),
     fxmem.SpecError, ["floating point"]),
    ("too many specs", analyze(("B", 6), ("B", 6)), fxmem.SpecError, ["got 2 input spec", "takes 1"]),
    ("no spec", analyze(), fxmem.SpecError, ["got 0 input spec"]),
    ("optional arg missing spec too", lambda: fxmem.analyze(TwoInputs()), fxmem.SpecError,
     ["takes 1 to 2", "mask have defaults"]),
    ("keyword-only forward", lambda: fxmem.analyze(KeywordOnly(), ("B", 6), mode="eager"), fxmem.SpecError,
     ["keyword-only argument(s) x"]),
    ("keyword-only forward graph", lambda: fxmem.analyze(KeywordOnly(), ("B", 6)), fxmem.SpecError, ["keyword-only"]),
    ("varargs forward", lambda: fxmem.analyze(VarArgs(), ("B", 6), mode="eager"), fxmem.SpecError, ["*args"]),
    ("wrong feature size", analyze(("B", 5)), fxmem.ShapeError, ["fx node 'linear'", "(B, 5)", "input"]),
    ("wrong rank", analyze(("B", "N")), fxmem.ShapeError, ["[B, N] X [6, 4]"]),
    ("wrong rank eager", analyze(("B", "N"), mode="eager"), fxmem.ShapeError, ["B"]),
    # --- analyze's options
    ("mode", analyze(("B", 6), mode="lazy"), fxmem.SpecError, ["mode='lazy'"]),
    ("mode None", analyze(("B", 6), mode=None), fxmem.SpecError, ["mode=None"]),
    ("dtype option", analyze(("B", 6), dtype="float32"), fxmem.SpecError, ["torch.dtype"]),
    ("dtype quantized option", analyze(("B", 6), dtype=torch.qint8), fxmem.SpecError, ["quantized"]),
    ("grad not bool", analyze(("B", 6), grad="yes"), fxmem.SpecError, ["grad must be True or False"]),
    ("grad int", analyze(("B", 6), grad=1), fxmem.SpecError, ["grad must be True or False"]),
    ("device", analyze(("B", 6), device="tpu"), fxmem.DeviceError, ["device='tpu'"]),
    ("device object", analyze(("B", 6), device=torch.device("cpu")), fxmem.DeviceError, ["device="]),
    ("hints not a dict", analyze(("B", 6), hints=[("B", 4)]), fxmem.SpecError, ["hints= must be a dict"]),
    ("hint unknown dim", analyze(("B", 6), hints={"Q": 4}), fxmem.SpecError, ["unknown dim(s) ['Q']"]),
    ("hint negative", analyze(("B", 6), hints={"B": -4}), fxmem.SpecError, ["dim 'B'", "at least 0"]),
    ("hint float", analyze(("B", 6), hints={"B": 4.5}), fxmem.SpecError, ["not a whole number"]),
    ("hint bool", analyze(("B", 6), hints={"B": True}), fxmem.SpecError, ["not a whole number"]),
    ("hint string", analyze(("B", 6), hints={"B": "4+1"}), fxmem.SpecError, ["not a whole number"]),
    ("hint huge", analyze(("B", 6), hints={"B": 2**70}), fxmem.SpecError, ["larger than any size"]),
    ("leaf_modules strings", analyze(("B", 6), leaf_modules=["Linear"]), fxmem.TraceError, ["'Linear' is not an nn.Module class"]),
    ("leaf_modules a class", analyze(("B", 6), leaf_modules=nn.Linear), fxmem.TraceError, ["list of nn.Module classes"]),
    ("leaf_modules instance", analyze(("B", 6), leaf_modules=[nn.Linear(2, 2)]), fxmem.TraceError, ["not an nn.Module class"]),
    ("leaf_modules non-module", analyze(("B", 6), leaf_modules=[int]), fxmem.TraceError, ["not an nn.Module class"]),
    ("optimizer not callable", analyze(("B", 6), optimizer="adam"), fxmem.SpecError, ["optimizer= must be a function"]),
    ("optimizer returns junk", analyze(("B", 6), optimizer=lambda p: 3), fxmem.FxMemError, ["torch.optim.Optimizer"]),
    ("optimizer LBFGS", analyze(("B", 6), optimizer=lambda p: torch.optim.LBFGS(p)), fxmem.FxMemError, ["closure"]),
    ("optimizer raises", analyze(("B", 6), optimizer=lambda p: torch.optim.SGD(p, lr=-1.0)), fxmem.ModelError,
     ["your optimizer factory raised ValueError", "Invalid learning rate"]),
    ("loss without optimizer", analyze(("B", 6), loss=lambda o: o.sum()), fxmem.SpecError, ["pass optimizer="]),
    ("loss not callable", analyze(("B", 6), optimizer=SGD, loss="mse"), fxmem.SpecError, ["loss= must be a function"]),
    ("loss returns float", analyze(("B", 6), optimizer=SGD, loss=lambda o: 1.0), fxmem.SpecError, ["returned float"]),
    ("loss returns None", analyze(("B", 6), optimizer=SGD, loss=lambda o: None), fxmem.SpecError, ["returned NoneType"]),
    ("loss not reduced", analyze(("B", 6), optimizer=SGD, loss=lambda o: o), fxmem.SpecError, ["(B, 4)", "one element"]),
    ("loss detached", analyze(("B", 6), optimizer=SGD, loss=lambda o: o.sum().detach()), fxmem.SpecError,
     ["does not require grad"]),
    ("loss raises", analyze(("B", 6), optimizer=SGD, loss=lambda o: o["x"]), fxmem.FxMemError, ["the loss"]),
    ("training without grad", analyze(("B", 6), optimizer=SGD, grad=False), fxmem.FxMemError, ["needs grad=True"]),
    ("nothing to train", lambda: fxmem.analyze(lin().requires_grad_(False), ("B", 6), optimizer=SGD),
     fxmem.FxMemError, ["nothing to train"]),
    ("kernels not a dict", analyze(("B", 6), kernels=[1]), fxmem.SpecError, ["kernels= must be a dict"]),
    ("kernels key a string", analyze(("B", 6), kernels={"aten::mm": lambda c: None}), fxmem.SpecError, ["not a torch op"]),
    ("kernels value junk", analyze(("B", 6), kernels={torch.ops.aten.mm.default: 3}), fxmem.SpecError,
     ["must be a function"]),
    # --- the model
    ("model a function", lambda: fxmem.analyze(lambda x: x, ("B", 6)), fxmem.ModelError, ["got function"]),
    ("model None", lambda: fxmem.analyze(None, ("B", 6)), fxmem.ModelError, ["must be a torch.nn.Module"]),
    ("model a class", lambda: fxmem.analyze(nn.Linear, ("B", 6)), fxmem.ModelError, ["its class with hparams"]),
    ("model a string", lambda: fxmem.analyze("resnet50", ("B", 6)), fxmem.ModelError, ["must be a torch.nn.Module"]),
    ("hparams on an instance", lambda: fxmem.analyze(lin(), ("B", 6), hparams={"in_features": "F"}), fxmem.ModelError,
     ["class or a factory"]),
    ("hparams not a dict", lambda: fxmem.analyze(nn.Linear, ("B", "F"), hparams=["in_features"]), fxmem.SpecError,
     ["hparams= must be a dict"]),
    ("hparams unknown argument", lambda: fxmem.analyze(nn.Linear, ("B", "F"), hparams={"width": "F"},
                                                       init={"out_features": 4}), fxmem.SpecError, ["no argument 'width'"]),
    ("hparams code", lambda: fxmem.analyze(nn.Linear, ("B", "F"), hparams={"in_features": "__import__('os')"},
                                           init={"out_features": 4}), fxmem.SpecError, ["function call"]),
    ("hparams constant", lambda: fxmem.analyze(nn.Linear, ("B", 6), hparams={"in_features": 6}, init={"out_features": 4}),
     fxmem.SpecError, ["no dim name"]),
    ("init unknown argument", lambda: fxmem.analyze(nn.Linear, ("B", 6), init={"in_features": 6, "oops": 1}),
     fxmem.SpecError, ["no argument 'oops'"]),
    ("init missing argument", lambda: fxmem.analyze(nn.Linear, ("B", 6), init={"in_features": 6}), fxmem.ModelError,
     ["Linear(...) failed", "out_features", "init="]),
    # --- optimize and validate
    ("optimize a function", lambda: fxmem.optimize(lambda x: x, ("B", 6)), fxmem.ModelError, ["torch.nn.Module"]),
    ("optimize wrong dims", lambda: fxmem.optimize(lin(), ("B", 5)), fxmem.ShapeError, ["fx node 'linear'", "(B, 5)"]),
    ("optimize probe_sizes dict", lambda: fxmem.optimize(lin(), ("B", 6), probe_sizes={"B": 2}), fxmem.SpecError,
     ["probe_sizes"]),
    ("optimize probe_sizes one", lambda: fxmem.optimize(lin(), ("B", 6), probe_sizes=[{"B": 2}]), fxmem.SpecError,
     ["two or more"]),
    ("optimize probe_sizes same", lambda: fxmem.optimize(lin(), ("B", 6), probe_sizes=[{"B": 2}, {"B": 2}]),
     fxmem.SpecError, ["same size in every probe"]),
    ("optimize probe_sizes bool", lambda: fxmem.optimize(lin(), ("B", 6), probe_sizes=[{"B": True}, {"B": 3}]),
     fxmem.SpecError, ["not an integer"]),
    ("validate grad=False", lambda: fxmem.validate(lin(), ("B", 6), dims={"B": 4}, device="cpu", grad=False),
     fxmem.SpecError, ["grad=False", "training step", "no_grad"]),
    ("validate no dims", lambda: fxmem.validate(lin(), ("B", 6), dims={}, device="cpu"), fxmem.SpecError, ["dims="]),
    ("validate dims a list", lambda: fxmem.validate(lin(), ("B", 6), dims=[4], device="cpu"), fxmem.SpecError, ["dims="]),
    ("validate negative tolerance", lambda: fxmem.validate(lin(), ("B", 6), dims={"B": 4}, device="cpu", tolerance=-1),
     fxmem.SpecError, ["tolerance"]),
    ("validate nan tolerance", lambda: fxmem.validate(lin(), ("B", 6), dims={"B": 4}, device="cpu",
                                                      tolerance=float("nan")), fxmem.SpecError, ["tolerance"]),
    ("validate string tolerance", lambda: fxmem.validate(lin(), ("B", 6), dims={"B": 4}, device="cpu", tolerance="1%"),
     fxmem.SpecError, ["tolerance"]),
    ("validate device", lambda: fxmem.validate(lin(), ("B", 6), dims={"B": 4}, device="tpu"), fxmem.DeviceError,
     ["device='tpu'"]),
    ("validate optimized junk", lambda: fxmem.validate(lin(), ("B", 6), dims={"B": 4}, device="cpu", optimized=3),
     fxmem.SpecError, ["optimized="]),
    ("validate dims wrong", lambda: fxmem.validate(lin(), ("B", 6), dims={"B": 0}, device="cpu"), fxmem.SpecError,
     ["B=0 must be a positive integer"]),
]


def _with_backward_hook() -> nn.Module:
    m = lin()
    m.register_full_backward_hook(lambda *a: None)
    return m


REPORT_CALLS = [
    ("evaluate bool", lambda r: r.evaluate(B=True), ["B=True is not an integer"]),
    ("evaluate inf", lambda r: r.evaluate(B=float("inf")), ["B=inf is not an integer"]),
    ("evaluate nan", lambda r: r.evaluate(B=float("nan")), ["not an integer"]),
    ("evaluate fraction", lambda r: r.evaluate(B=2.5), ["B=2.5 is not an integer"]),
    ("evaluate string", lambda r: r.evaluate(B="4"), ["not an integer"]),
    ("evaluate None", lambda r: r.evaluate(B=None), ["not an integer"]),
    ("evaluate zero", lambda r: r.evaluate(B=0), ["must be a positive integer"]),
    ("evaluate negative", lambda r: r.evaluate(B=-3), ["must be a positive integer"]),
    ("evaluate huge", lambda r: r.evaluate(B=10**30), ["larger than any size"]),
    ("evaluate beyond int64 bytes", lambda r: r.evaluate(B=2**62), ["more bytes than torch"]),
    ("evaluate unknown dim", lambda r: r.evaluate(B=2, Q=3), ["unknown dim(s) ['Q']"]),
    ("evaluate missing dim", lambda r: r.evaluate(), ["missing dim(s) ['B']"]),
    ("at code", lambda r: r.at("__import__('os').system('touch pwned') + B", B=3), ["function call"]),
    ("at exec", lambda r: r.at("exec('1')", B=3), ["function call"]),
    ("at lambda", lambda r: r.at("(lambda: 1)()", B=3), ["function call"]),
    ("at unknown name", lambda r: r.at("B*N", B=3), ["'N'", "its dims: B"]),
    ("at power tower", lambda r: r.at("9**9**9", B=3), ["exponent"]),
    ("at a list", lambda r: r.at([1], B=3), ["expected a formula"]),
    ("at a foreign symbol", lambda r: r.at(fxmem.parsing.dim_symbol("Z") * 2, B=3), ["['Z']"]),
    ("at bad dims", lambda r: r.at(r.peak, B=-1), ["positive integer"]),
    ("max_size unknown dim", lambda r: r.max_size("Q", "1GiB"), ["'Q' is not a dim"]),
    ("max_size dim not a string", lambda r: r.max_size(3, "1GiB"), ["is not a dim"]),
    ("max_size fixed twice", lambda r: r.max_size("B", "1GiB", B=3), ["do not also fix it"]),
    ("max_size budget empty", lambda r: r.max_size("B", ""), ["budget"]),
    ("max_size budget negative", lambda r: r.max_size("B", "-1GiB"), ["budget"]),
    ("max_size budget zero", lambda r: r.max_size("B", 0), ["positive"]),
    ("max_size budget bool", lambda r: r.max_size("B", True), ["budget"]),
    ("max_size budget unit", lambda r: r.max_size("B", "1 parsec"), ["unit"]),
    ("max_size budget code", lambda r: r.max_size("B", "__import__('os')"), ["budget"]),
    ("max_size budget exponent", lambda r: r.max_size("B", "1e400GiB"), ["budget"]),
    ("max_size budget float", lambda r: r.max_size("B", float("inf")), ["budget"]),
    ("table bad dims", lambda r: r.table({"B": -1}), ["positive integer"]),
    ("summary bad dims", lambda r: r.summary({"Q": 1}), ["unknown dim"]),
    ("by_line bad dims", lambda r: r.by_line({"B": 0}), ["positive integer"]),
    ("diagram group", lambda r: r.diagram(group="block"), ["group='block'"]),
    ("diagram bad dims", lambda r: r.diagram({"B": "x"}), ["not an integer"]),
    ("render what", lambda r: r.render("x.svg", what="chart"), ["what='chart'"]),
    ("render extension", lambda r: r.render("x.docx"), [".svg"]),
    ("timeline bad dims", lambda r: r.timeline({"B": 2.5}), ["not an integer"]),
    ("liveness bad dims", lambda r: r.liveness({"B": True}), ["not an integer"]),
]


def _check_message(exc: BaseException, fragments: list[str]) -> None:
    text = str(exc)
    assert not INTERNAL.search(text), f"internal size symbol in: {text}"
    assert "Traceback" not in text
    for fragment in fragments:
        assert fragment in text, f"{fragment!r} not in: {text}"


@pytest.mark.parametrize("label, call, error, fragments", API, ids=[c[0] for c in API])
def test_api_bad_input_is_a_clear_error(label, call, error, fragments, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(error) as info:
        call()
    _check_message(info.value, fragments)
    assert not os.path.exists(tmp_path / "pwned")


@pytest.mark.parametrize("label, call, fragments", REPORT_CALLS, ids=[c[0] for c in REPORT_CALLS])
def test_report_bad_input_is_a_clear_error(label, call, fragments, report, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(fxmem.FxMemError) as info:
        call(report)
    _check_message(info.value, fragments)
    assert not os.path.exists(tmp_path / "pwned")


def test_there_are_enough_cases():
    assert len(API) + len(REPORT_CALLS) >= 140


# --- legal corner cases work, exactly --------------------------------------------------------------
def test_a_dim_that_is_zero_at_the_given_sizes_is_a_legal_empty_input():
    report = check_against_real_run(lin(), (("B", "N-1", 6),), [dict(B=2, N=1), dict(B=3, N=2)])
    assert report.evaluate(B=2, N=1)["output"] == 0


def test_an_optional_argument_without_a_spec_keeps_its_default():
    check_against_real_run(TwoInputs(), (("B", 6),), [dict(B=3), dict(B=40)])
    check_against_real_run(TwoInputs(), (("B", 6), ("B", 4)), [dict(B=3), dict(B=40)])


def test_hooks_on_the_model_are_left_out_of_the_analysis_and_said():
    """The user's hooks would see fx Proxies and fake tensors (fxmem/isolation.py): the analysis is of
    the model without them - equal to real runs of that model - and the report names them."""
    model = lin()
    model.register_forward_hook(lambda mod, args, out: torch.cat([out, out], -1) * 2)
    bare = _with_backward_hook()
    for m in (model, bare):
        report = check_against_real_run(m, (("B", 6),), [dict(B=3), dict(B=50)])
        assert any("hooks were left out" in n for n in report.notes)
        assert report.evaluate(B=7)["output"] == 7 * 4 * 4  # the forward's own output, not the hook's
    assert "backward hook" in next(n for n in fxmem.analyze(bare, ("B", 6), mode="graph").notes if "hooks" in n)


def test_torchs_own_log_lines_do_not_reach_the_user(capfd):
    with pytest.raises(fxmem.ShapeError):
        fxmem.analyze(lin(), ("B", "N"))
    err = capfd.readouterr().err
    assert "fake_tensor.py" not in err and "Traceback" not in err, err
