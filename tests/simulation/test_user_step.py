"""``step=``: the user's own training step, simulated as written, checked against the same step run
for real (steady state: the step runs once, then its second call is measured, as in a real loop)
at sizes the analysis did not see."""
from __future__ import annotations

import functools

import pytest
import torch

import fxmem
from fxmem.measure import measure


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 48), torch.nn.Linear(48, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def adam(params):
    return torch.optim.Adam(params, lr=1e-3)


def accumulate(model, opt, x, micro=2):
    for xb in x.chunk(micro):
        (model(xb).pow(2).mean() / micro).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()


def keep_grads(model, opt, x):
    model(x).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=False)


def module_zero_grad(model, opt, x):
    model(x).abs().mean().backward()
    opt.step()
    model.zero_grad()


def two_losses(model, opt, x):
    out = model(x)
    main, aux = out.pow(2).mean(), out.abs().sum()
    (main + 0.1 * aux).backward()
    opt.step()
    opt.zero_grad()


def drops_output(model, opt, x):
    out = model(x)
    loss = out.pow(2).mean()
    del out  # freed before backward: only what autograd saved stays
    loss.backward()
    opt.step()
    opt.zero_grad()


def scaled(model, opt, x, scaler):
    loss = model(x).pow(2).mean()
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()


STEPS = {
    "accumulate 2": accumulate,
    "accumulate 4": functools.partial(accumulate, micro=4),
    "zero_grad(set_to_none=False)": keep_grads,
    "model.zero_grad()": module_zero_grad,
    "two losses": two_losses,
    "output dropped before backward": drops_output,
}


def real_step_bytes(step, model, opt, x) -> tuple[int, int]:
    step(model, opt, x)  # the first call creates the optimizer's state (and whatever the step keeps)
    m = measure(lambda: step(model, opt, x))
    return m.peak_above_start, m.retained


def check(step, sizes, make_real_step=None, model_class=MLP, **analyze_kw) -> fxmem.Report:
    torch.manual_seed(0)
    model = model_class()
    report = fxmem.analyze(model, ("B", 8), optimizer=adam, step=step, **analyze_kw)
    assert report.exact, report.notes
    for B in sizes:
        x = torch.randn(B, 8)
        opt = adam(model.parameters())
        real = make_real_step() if make_real_step else step
        measured = real_step_bytes(real, model, opt, x)
        pred = report.evaluate(B=B)
        assert measured == (pred["train_peak"] - pred["train_resident"], pred["train_retained"]), (B, report.summary())
        kept = sum(p.grad.untyped_storage().nbytes() for p in model.parameters() if p.grad is not None)
        state = sum(t.untyped_storage().nbytes() for s in opt.state.values() for t in s.values()
                    if isinstance(t, torch.Tensor))
        params = sum(p.untyped_storage().nbytes() for p in model.parameters())
        extra = 0
        if make_real_step:  # the GradScaler's scale and growth tracker
            extra = sum(t.untyped_storage().nbytes() for t in (real.keywords["scaler"]._scale,
                                                                real.keywords["scaler"]._growth_tracker))
        assert pred["train_resident"] == params + x.untyped_storage().nbytes() + kept + state + extra
        for p in model.parameters():
            p.grad = None
    return report


@pytest.mark.parametrize("name", list(STEPS))
def test_user_step_matches_the_same_step_run_for_real(name):
    report = check(STEPS[name], [6, 20])
    assert "your step= function" in report.summary()


class Scaled(MLP):
    """Python numbers in the forward: autograd keeps each as a wrapped 0-d tensor (8 bytes) in the
    node that multiplies or divides by it, without a saved-tensor hook."""

    def forward(self, x):
        return self.b(torch.relu(self.a(x)) * 0.5) / 4


def two_backwards_through_one_graph(model, opt, x):
    out = model(x)
    out.pow(2).mean().backward(retain_graph=True)  # the graph stays for the second loss
    out.abs().mean().backward()
    opt.step()
    opt.zero_grad()


def graph_kept_through_the_optimizer(model, opt, x):
    loss = model(x).pow(2).mean()
    loss.backward(retain_graph=True)  # what the graph saved lives on until `loss` goes
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("step", [two_backwards_through_one_graph, graph_kept_through_the_optimizer])
def test_a_backward_that_keeps_its_graph_keeps_what_its_nodes_saved(step):
    # backward(retain_graph=True) frees nothing the graph's nodes saved, wrapped numbers included (fxmem
    # released those as each node's backward ran: 8 to 16 bytes low, and called exact)
    check(step, [6, 20], model_class=Scaled)


LOGGED: list = []


def logs_its_output(model, opt, x):
    out = model(x)
    out.sum().backward()
    opt.step()
    opt.zero_grad()
    LOGGED[:] = [out.detach()]  # a logger's last output: kept until the next step replaces it


def test_a_tensor_the_step_keeps_is_named_in_the_users_dims_and_their_list_is_left_alone():
    LOGGED[:] = ["before"]
    history = LOGGED
    torch.manual_seed(0)
    model = MLP()
    report = fxmem.analyze(model, ("B", 8), optimizer=adam, step=logs_its_output)
    assert LOGGED is history and LOGGED == ["before"]  # not a fake tensor of the simulation's
    assert any("a torch.float32 tensor (B, 4) the step keeps" in n for n in report.notes), report.notes
    for B in (6, 20):
        x = torch.randn(B, 8)
        measured = real_step_bytes(logs_its_output, model, adam(model.parameters()), x)
        pred = report.evaluate(B=B)
        assert measured == (pred["train_peak"] - pred["train_resident"], pred["train_retained"]), B
        assert LOGGED[0].untyped_storage().nbytes() == B * 4 * 4  # resident: counted in train_resident
        for p in model.parameters():
            p.grad = None
    LOGGED.clear()


def test_gradscaler_step_matches_and_the_scaler_is_left_alone():
    scaler = torch.amp.GradScaler("cpu")
    step = functools.partial(scaled, scaler=scaler)
    report = check(step, [6, 12], make_real_step=lambda: functools.partial(scaled, scaler=torch.amp.GradScaler("cpu")))
    assert scaler._scale is None and not scaler._per_optimizer_states  # untouched by the simulation
    assert any("GradScaler" in n for n in report.notes)


def test_eager_mode_user_step():
    check(accumulate, [10], mode="eager")


def test_the_default_step_is_stated_and_a_written_out_default_gives_the_same_formulas():
    model = MLP()

    def default(model, opt, x):  # as fxmem.training.train_step: the output is a local until the step returns
        out = model(x)
        loss = out.sum()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    plain = fxmem.analyze(model, ("B", 8), optimizer=adam)
    mine = fxmem.analyze(model, ("B", 8), optimizer=adam, step=default)
    assert "training step: the default step: out = model(*inputs); loss = loss_fn(out); loss.backward()" in \
        plain.summary() and "out and loss held until the step returns" in plain.summary()
    for key in ("train_resident", "train_peak", "grads", "optimizer_state"):
        assert plain.formulas()[key] == mine.formulas()[key], key


def test_accumulation_peaks_differ_from_the_default_step():
    model = MLP()
    plain = fxmem.analyze(model, ("B", 8), optimizer=adam).evaluate(B=64)
    micro = fxmem.analyze(model, ("B", 8), optimizer=adam, step=functools.partial(accumulate, micro=4)).evaluate(B=64)
    assert micro["train_peak"] < plain["train_peak"]


@pytest.mark.parametrize("kw, fragment", [
    ({"step": accumulate}, "pass optimizer="),
    ({"step": accumulate, "optimizer": adam, "loss": lambda out: out.sum()}, "not both"),
    ({"step": "accumulate", "optimizer": adam}, "must be your training step"),
    ({"step": accumulate, "optimizer": adam, "grad": False}, "grad=True"),
])
def test_step_option_refusals(kw, fragment):
    with pytest.raises(fxmem.SpecError, match=fragment):
        fxmem.analyze(MLP(), ("B", 8), **kw)
