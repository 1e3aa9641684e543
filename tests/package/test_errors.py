"""Bad input gets a clear error naming the argument, the fx node or source line, and what to do.
Nothing may crash the interpreter or silently return a number."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn

import fxmem
from conftest import ROOT, load_example

gat = load_example("seed_gat")
SPECS = (("B", "N", 6), ("B", "N", "N"))


def layer():
    return gat.GraphAttentionLayerFixed(6, 16)


def test_wrong_number_of_specs_names_the_arguments():
    with pytest.raises(fxmem.SpecError, match=r"got 1 input spec.*takes 2.*\(inp, adj\)"):
        fxmem.analyze(layer(), ("B", "N", 6))
    with pytest.raises(fxmem.SpecError, match="got 3 input spec"):
        fxmem.analyze(layer(), *SPECS, ("B",))


def test_wrong_rank_names_argument_node_and_line():
    with pytest.raises(fxmem.ShapeError) as err:
        fxmem.analyze(layer(), ("B", "N"), ("B", "N", "N"))  # inp should be rank 3 with 6 features
    msg = str(err.value)
    assert "fx node 'matmul'" in msg
    assert "seed_gat.py:" in msg and "torch.matmul(inp, self.W)" in msg
    assert "'inp' (B, N)" in msg
    assert "what to do" in msg


def test_mismatched_sizes_between_arguments():
    with pytest.raises(fxmem.ShapeError) as err:
        fxmem.analyze(layer(), ("B", "N", 6), ("B", "M", "M"))  # adj must be N x N
    assert "'adj' (B, M, M)" in str(err.value)


def test_malformed_specs():
    with pytest.raises(fxmem.SpecError, match="argument 'inp'.*tuple of dims"):
        fxmem.analyze(layer(), "B,N,6", ("B", "N", "N"))
    with pytest.raises(fxmem.SpecError, match="dim 2.*1.5"):
        fxmem.analyze(layer(), ("B", "N", 1.5), ("B", "N", "N"))
    with pytest.raises(fxmem.SpecError, match="negative"):
        fxmem.analyze(layer(), ("B", "N", -6), ("B", "N", "N"))
    with pytest.raises(fxmem.SpecError, match="cannot parse"):
        fxmem.analyze(layer(), ("B", "N+", 6), ("B", "N", "N"))
    with pytest.raises(fxmem.SpecError, match="hints name unknown dim"):
        fxmem.analyze(layer(), *SPECS, hints={"Q": 3})
    with pytest.raises(fxmem.SpecError, match="dtype"):
        fxmem.analyze(layer(), *SPECS, dtype="float32")


def test_evaluate_rejects_missing_unknown_and_non_positive_dims():
    report = fxmem.analyze(layer(), *SPECS)
    with pytest.raises(fxmem.SpecError, match=r"missing dim\(s\) \['B', 'N'\]"):
        report.evaluate()
    with pytest.raises(fxmem.SpecError, match=r"missing dim\(s\) \['N'\]"):
        report.evaluate(B=4)
    with pytest.raises(fxmem.SpecError, match=r"unknown dim\(s\) \['Q'\]"):
        report.evaluate(B=4, N=5, Q=2)
    with pytest.raises(fxmem.SpecError, match="N=0 must be a positive integer"):
        report.evaluate(B=4, N=0)
    with pytest.raises(fxmem.SpecError, match="N=-3 must be a positive integer"):
        report.evaluate(B=4, N=-3)
    with pytest.raises(fxmem.SpecError, match="not an integer"):
        report.evaluate(B=4, N=2.5)


def test_dims_that_make_a_shape_negative():
    class Shift(nn.Module):
        def forward(self, x):
            return x * 2

    report = fxmem.analyze(Shift(), ("N-5", 3))
    assert report.evaluate(N=9)["output"] == 4 * 3 * 4
    with pytest.raises(fxmem.SpecError, match=r"input 'x' \(N-5, 3\): dim 0 = N - 5 is -2"):
        report.evaluate(N=3)


def test_sizes_too_small_for_a_convolution_name_the_node():
    model = nn.Sequential(nn.Conv2d(3, 4, 5), nn.ReLU())
    report = fxmem.analyze(model, ("B", 3, "H", "W"))
    with pytest.raises(fxmem.ShapeError, match="fx node '_0'"):
        report.evaluate(B=2, H=3, W=9)  # a 5x5 kernel does not fit a 3-pixel image


def test_op_without_fake_kernel_is_named():
    @torch.library.custom_op("fxmem_test::opaque", mutates_args=())
    def opaque(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    class UsesOpaque(nn.Module):
        def forward(self, x):
            return opaque(x) + 1

    with pytest.raises(fxmem.UnsupportedOpError, match=r"fxmem_test.opaque.*no meta/fake kernel.*register_fake"):
        fxmem.analyze(UsesOpaque(), ("B", 4))


def test_data_dependent_size_is_a_named_dim_and_a_branch_on_values_is_refused():
    class Masked(nn.Module):
        def forward(self, x):
            return x[x > 0]

    report = fxmem.analyze(Masked(), ("B", 4))
    assert "K1" in report.symbols and "K1 <= 4*B" in report.data_dims["K1"]  # the user's dims, never u0
    with pytest.raises(fxmem.SpecError, match="give the value of K1"):
        report.evaluate(B=3)

    class OnValues(nn.Module):
        def forward(self, x):
            return x * 2 if bool((x > 0).any()) else x

    with pytest.raises(fxmem.UnsupportedOpError, match=r"test_errors.py:\d+: .*decides on tensor values"):
        fxmem.analyze(OnValues(), ("B", 4))


def test_not_a_module():
    with pytest.raises(fxmem.ModelError, match="must be a torch.nn.Module, got function"):
        fxmem.analyze(lambda x: x, ("B",))


def test_untraceable_model_points_at_the_line():
    class Branchy(nn.Module):
        def forward(self, x):
            if x.sum() > 0:
                return x
            return -x

    with pytest.raises(fxmem.TraceError) as err:
        fxmem.analyze(Branchy(), ("B", 3), mode="graph")
    msg = str(err.value)
    assert "test_errors.py:" in msg and "if x.sum() > 0" in msg and "what to do" in msg and "mode='eager'" in msg
    # the default falls back to the original forward, where the branch on a value is refused, naming the line
    with pytest.raises(fxmem.UnsupportedOpError, match=r"test_errors.py:\d+: if x.sum\(\) > 0"):
        fxmem.analyze(Branchy(), ("B", 3))


@pytest.mark.skipif(torch.backends.cuda.is_built(), reason="checks the CPU-only build's refusal")
def test_cuda_on_cpu_only_build_is_an_error_not_an_abort():
    # a fake cuda tensor with grad aborts the process on a CPU-only build: run in a subprocess so
    # that a regression shows as a failed test rather than a dead test runner
    code = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {str(ROOT)!r})
        import torch, fxmem
        try:
            fxmem.analyze(torch.nn.Linear(4, 4), ("B", 4), device="cuda")
        except fxmem.DeviceError as e:
            print("DeviceError:", e)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "DeviceError: device='cuda' cannot be simulated" in out.stdout
    assert "CPU-only build" in out.stdout


def test_unknown_device():
    with pytest.raises(fxmem.DeviceError, match="device='tpu'"):
        fxmem.analyze(layer(), *SPECS, device="tpu")
