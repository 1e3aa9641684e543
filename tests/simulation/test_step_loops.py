"""``step=`` as training loops are written (issue 43): LR schedulers, a GAN's two optimizers, parts of
the model the forward does not use, and ``torch.compile``.

Each prediction is checked against the SAME step function run for real on the CPU allocator
(:func:`fxmem.measure.measure`), in its steady state (after a first call made the optimizer's
state), at sizes the analysis did not see (the analysis is made at ``HINT``).
"""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

import fxmem
from fxmem.measure import measure
from test_user_step import MLP, keep_grads

HINT = {"B": 16}  # the example size of every analysis here; the real runs use other sizes
SIZES = (5, 23)


class GAN(torch.nn.Module):
    """A generator whose forward never runs its discriminator ``d`` (the step calls it)."""

    def __init__(self) -> None:
        super().__init__()
        self.g = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
        self.d = torch.nn.Sequential(torch.nn.Linear(8, 24), torch.nn.LeakyReLU(0.2), torch.nn.Linear(24, 1))

    def forward(self, z):
        return self.g(z)


class WithUnused(torch.nn.Module):
    """A model with a head its forward never calls: its parameters get no gradient, so torch.optim
    makes no state for them (it does so lazily, for parameters whose ``.grad`` is not None)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 40), torch.nn.GELU(), torch.nn.Linear(40, 6))
        self.unused_head = torch.nn.Linear(8, 300)

    def forward(self, x):
        return self.body(x)


def storages_bytes(tensors) -> int:
    """Bytes of the distinct storages of ``tensors``."""
    seen = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def optimizers_in(handed) -> list[torch.optim.Optimizer]:
    parts = list(handed.values()) if isinstance(handed, dict) else list(handed) \
        if isinstance(handed, (tuple, list)) else [handed]
    return [p for p in parts if isinstance(p, torch.optim.Optimizer)]


def resident_now(model, x, handed) -> int:
    """What a real loop holds between steps: parameters, buffers, the input, the optimizers' state
    and the gradients kept from the last step (bytes)."""
    own = [v for v in vars(model).values() if isinstance(v, torch.optim.Optimizer)]  # the step's own (a GAN's)
    state = [t for opt in optimizers_in(handed) + own for s in opt.state.values() for t in s.values()]
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return storages_bytes([*model.parameters(), *model.buffers(), x, *state, *grads])


def check_real(model_cls, factory, step, sizes=SIZES, **analyze_kw) -> fxmem.Report:
    """Analyse ``step`` at ``HINT``; run it for real at ``sizes`` and compare ``train_peak``,
    ``train_resident`` and ``train_retained`` (bytes) exactly."""
    torch.manual_seed(0)
    model = model_cls()
    report = fxmem.analyze(model, ("B", 8), optimizer=factory, step=step, hints=HINT, check=False, **analyze_kw)
    assert report.exact, report.notes
    for B in sizes:
        assert B not in HINT.values()
        x = torch.randn(B, 8)
        handed = factory(list(model.parameters()))
        step(model, handed, x)  # the first call makes the optimizers' state (and what the step keeps)
        step(model, handed, x)
        resident = resident_now(model, x, handed)
        m = measure(lambda: step(model, handed, x), warmup=0)
        pred = report.evaluate(B=B)
        assert (pred["train_resident"], pred["train_peak"], pred["train_retained"]) == \
            (resident, resident + m.peak_above_start, m.retained), (B, report.summary())
        for p in model.parameters():
            p.grad = None
    return report


# ---- LR schedulers -------------------------------------------------------------------------------

def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def with_scheduler(make):
    """An optimizer factory returning ``(optimizer, make(optimizer))``: what the step is handed."""
    def factory(params):
        opt = sgd(params)
        return opt, make(opt)
    return factory


def scheduled_step(model, handed, x):
    opt, sched = handed
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    sched.step()
    opt.zero_grad()


SCHEDULERS = {
    "StepLR": lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5),
    "OneCycleLR": lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.5, total_steps=1000),
    "LambdaLR": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 0.9 ** epoch),
    "CosineAnnealingLR": lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10),
}


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_a_scheduler_from_the_factory_matches_the_real_loop(name):
    report = check_real(MLP, with_scheduler(SCHEDULERS[name]), scheduled_step)
    assert report.evaluate(B=7)["optimizer_state"] == 4 * sum(p.numel() for p in MLP().parameters())  # momentum


def step_making_its_scheduler(model, opt, x):
    """A scheduler made inside the step, on the optimizer it is handed (it wraps ``opt.step``)."""
    sched = getattr(opt, "my_scheduler", None)
    if sched is None:
        sched = opt.my_scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    model(x).abs().mean().backward()
    opt.step()
    sched.step()
    opt.zero_grad()


def step_making_a_scheduler_each_call(model, opt, x):
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 1.0 / (1 + epoch))
    model(x).pow(2).sum().backward()
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=False)


@pytest.mark.parametrize("step", [step_making_its_scheduler, step_making_a_scheduler_each_call])
def test_a_scheduler_made_inside_the_step_matches_the_real_loop(step):
    check_real(MLP, sgd, step)


def test_the_users_optimizer_scheduler_and_model_are_untouched():
    torch.manual_seed(0)
    model = MLP()
    factory = with_scheduler(SCHEDULERS["OneCycleLR"])
    opt, sched = factory(model.parameters())
    x = torch.randn(4, 8)
    scheduled_step(model, (opt, sched), x)  # the user's loop has run a step already
    before = (sched.last_epoch, sched._step_count, [g["lr"] for g in opt.param_groups],
              [g["momentum"] for g in opt.param_groups], [p.detach().clone() for p in model.parameters()])
    had = {id(p): (p.grad is None) for p in model.parameters()}
    calls = itertools.count()  # (a list the step appends to is put back as it was, as the user's objects are)

    def step(model_, handed, x_):  # closes over the user's real loop objects, as notebooks do
        next(calls)
        scheduled_step(model_, handed, x_)

    report = fxmem.analyze(model, ("B", 8), optimizer=factory, step=step, hints=HINT, check=False)
    assert next(calls) == 2  # the warm-up and the recorded call ran
    after = (sched.last_epoch, sched._step_count, [g["lr"] for g in opt.param_groups],
             [g["momentum"] for g in opt.param_groups], [p.detach().clone() for p in model.parameters()])
    assert after[:4] == before[:4]
    assert all(torch.equal(a, b) for a, b in zip(after[4], before[4]))
    assert {id(p): (p.grad is None) for p in model.parameters()} == had
    assert hasattr(opt.step, "_wrapped_by_lr_sched")  # the scheduler's wrapper is still the optimizer's
    assert torch.optim.Optimizer.zero_grad.__qualname__ == "Optimizer.zero_grad"  # the routing is undone
    assert report.evaluate(B=3)["train_peak"] > 0


def test_the_schedulers_step_is_in_the_step_phases_own_code():
    """``optimizer.step()`` is routed through torch's optimizer-step hooks, so a scheduler's wrapper
    around it keeps working and the optimizer's update is attributed to its phase."""
    report = fxmem.analyze(MLP(), ("B", 8), optimizer=sgd, step=step_making_a_scheduler_each_call,
                           hints=HINT, check=False)
    phases = {n.name for n in report.nodes if n.op == "phase"}
    assert {"backward", "optimizer.step", "zero_grad"} <= phases, phases


# ---- a GAN: two optimizers, a discriminator the forward does not run ------------------------------

def gan_optimizers(params):
    """The generator's and the discriminator's Adam (fxmem hands ``model.parameters()``, in order)."""
    params = list(params)
    return (torch.optim.Adam(params[:4], lr=2e-4, betas=(0.5, 0.999)),
            torch.optim.Adam(params[4:], lr=2e-4, betas=(0.5, 0.999)))


def gan_step(model, optimizers, z):
    g_opt, d_opt = optimizers
    fake = model(z)
    real = torch.randn_like(fake)
    d_opt.zero_grad()
    d_loss = F.softplus(-model.d(real)).mean() + F.softplus(model.d(fake.detach())).mean()
    d_loss.backward()
    d_opt.step()
    g_opt.zero_grad()
    g_loss = F.softplus(-model.d(fake)).mean()
    g_loss.backward()  # also fills the discriminator's grads: kept until its next zero_grad
    g_opt.step()


def gan_step_with_its_own_d_optimizer(model, g_opt, z):
    """The discriminator's optimizer made by the step on first use and kept on the model."""
    d_opt = getattr(model, "d_opt", None)
    if d_opt is None:
        d_opt = model.d_opt = torch.optim.Adam(model.d.parameters(), lr=1e-4)
    fake = model(z)
    d_loss = (model.d(fake.detach()) - 1).pow(2).mean()
    d_loss.backward()
    d_opt.step()
    d_opt.zero_grad()
    model.d(fake).pow(2).mean().backward()
    g_opt.step()
    g_opt.zero_grad()


def test_a_gan_with_two_optimizers_from_the_factory_matches_the_real_loop():
    report = check_real(GAN, gan_optimizers, gan_step)
    assert report.mode == "eager" and "model.d" in report.capture.text  # chosen for the step, and said why
    n = sum(p.numel() for p in GAN().parameters())
    assert report.evaluate(B=9)["optimizer_state"] == 2 * 4 * n + 4 * 8  # exp_avg(_sq) + 8 step counters


def test_a_gan_whose_step_makes_the_second_optimizer_matches_the_real_loop():
    check_real(GAN, lambda p: torch.optim.Adam(p, lr=1e-4), gan_step_with_its_own_d_optimizer)


def test_explicit_graph_mode_refuses_a_step_calling_code_the_graph_lacks():
    with pytest.raises(fxmem.TraceError, match=r"(?s)model\.d,.*mode='eager'"):
        fxmem.analyze(GAN(), ("B", 8), optimizer=gan_optimizers, step=gan_step, mode="graph", check=False)


def test_several_optimizers_need_a_step():
    with pytest.raises(fxmem.SpecError, match="pass step=fn"):
        fxmem.analyze(GAN(), ("B", 8), optimizer=gan_optimizers, check=False)
    with pytest.raises(fxmem.SpecError, match="holding str"):
        fxmem.analyze(GAN(), ("B", 8), optimizer=lambda p: (torch.optim.SGD(p, lr=0.1), "adam"), step=gan_step,
                      check=False)


# ---- submodules the forward does not use ---------------------------------------------------------

def plain_step(model, opt, x):
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("factory", [
    lambda p: torch.optim.Adam(p, lr=1e-3),
    lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    lambda p: torch.optim.AdamW(p, lr=1e-3, foreach=False),
], ids=["Adam", "SGD momentum", "AdamW for-loop"])
@pytest.mark.parametrize("step", [plain_step, keep_grads])
def test_unused_parameters_get_no_state_as_in_the_real_loop(factory, step):
    report = check_real(WithUnused, factory, step)
    used = sum(p.numel() for p in WithUnused().body.parameters())
    state = report.evaluate(B=7)["optimizer_state"]
    assert state < 4 * sum(p.numel() for p in WithUnused().parameters())  # none for the unused head
    assert state in (4 * used, 2 * 4 * used + 4 * 4)  # momentum; Adam's two moments and 4 step counters


# ---- torch.compile -------------------------------------------------------------------------------

def compiling_step(model, opt, x):
    torch.compile(model)(x).sum().backward()
    opt.step()
    opt.zero_grad()


def module_compile_step(model, opt, x):
    model.compile()
    model(x).sum().backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("step, fragment", [
    (torch.compile(plain_step), "step= is a torch.compile'd function"),
    (compiling_step, "calls torch.compile"),
    (module_compile_step, "calls torch.compile"),
])
def test_torch_compile_in_a_step_is_refused_clearly(step, fragment):
    original = torch.compile, torch.nn.Module.compile
    with pytest.raises(fxmem.SpecError, match=fragment) as info:
        fxmem.analyze(MLP(), ("B", 8), optimizer=sgd, step=step, check=False)
    assert "without torch.compile" in str(info.value)
    assert (torch.compile, torch.nn.Module.compile) == original  # put back


# ---- values read by the step's own code ----------------------------------------------------------

def plateau_step(model, handed, x):
    opt, sched = handed
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    sched.step(loss.item())  # reads the loss's value: fake tensors have none


def test_a_value_read_in_the_step_is_named_not_blamed_on_the_optimizer():
    factory = with_scheduler(torch.optim.lr_scheduler.ReduceLROnPlateau)
    with pytest.raises(fxmem.UnsupportedOpError, match=r"reads the value of a tensor \(loss\.item\(\)") as info:
        fxmem.analyze(MLP(), ("B", 8), optimizer=factory, step=plateau_step, check=False)
    assert "torch.optim.SGD" not in str(info.value)
