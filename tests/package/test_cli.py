"""The command line prints the same formulas and numbers as the API."""
from __future__ import annotations

import json
import subprocess
import sys

import torch

import fxmem
import fxmem.cli
from conftest import ROOT, load_example
from fxmem.cli import parse_input

gat = load_example("seed_gat")


def run(*args):
    return subprocess.run([sys.executable, "-m", "fxmem", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=600)


def test_analyze_prints_formulas_and_numbers():
    out = run("analyze", "examples/seed_gat.py:GraphAttentionLayer", "--input", "B,N,6", "--input", "B,N,N",
              "--dims", "B=4,N=500")
    assert out.returncode == 0, out.stderr
    report = fxmem.analyze(gat.GraphAttentionLayer(), ("B", "N", 6), ("B", "N", "N"))
    n = report.evaluate(B=4, N=500)
    assert f"peak            = {report.peak}" in out.stdout
    assert f"{n['peak']:,} B" in out.stdout
    assert "1024*B*N**2" not in out.stdout  # with --dims the table shows numbers
    assert "976.56 MiB" in out.stdout


def test_json_and_init_arguments():
    out = run("analyze", "examples/seed_attention.py:Attention", "--init", "dim=64,num_heads=4",
              "--input", "B,L,64", "--dims", "B=2,L=8", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    report = fxmem.analyze(load_example("seed_attention").Attention(64, 4), ("B", "L", 64))
    assert data["formulas"]["retained"] == str(report.retained)
    assert data["evaluated"]["bytes"] == report.evaluate(B=2, L=8)


def test_bad_input_is_a_clear_error_with_exit_code_2():
    out = run("analyze", "examples/seed_gat.py:GraphAttentionLayer", "--input", "B,N")
    assert out.returncode == 2
    assert "fxmem: error:" in out.stderr and "takes 2 tensor argument(s) (inp, adj)" in out.stderr
    out = run("analyze", "examples/seed_gat.py:Nope", "--input", "B,N,6")
    assert out.returncode == 2 and "has no 'Nope'" in out.stderr and "GraphAttentionLayer" in out.stderr


def test_input_dtype_suffix():
    spec = parse_input("2,E:int64")
    assert spec.shape == (2, "E") and str(spec.dtype) == "torch.int64"


def test_validate_command_on_cpu():
    out = run("validate", "examples/seed_gat.py:GraphAttentionLayerFixed", "--input", "B,N,6", "--input", "B,N,N",
              "--dims", "B=2,N=9", "--device", "cpu", "--optimizer", "adam")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "training step: peak above resident" in out.stdout and "all within 1.0%: yes" in out.stdout


def test_eager_lines_and_training_flags():
    out = run("analyze", "examples/seed_attention.py:Attention", "--init", "dim=64", "--input", "B,L,64",
              "--mode", "eager", "--lines", "--optimizer", "sgd", "--dims", "B=2,L=8")
    assert out.returncode == 0, out.stderr
    assert "qkv = self.qkv(x)" in out.stdout and "train_peak" in out.stdout and "memory" in out.stdout


def test_help_and_version_do_not_import_torch():
    # `fxmem --help` answers at once: torch (seconds to import) is loaded only after parsing
    code = ("import sys, contextlib, io\n"
            "import fxmem.cli\n"
            "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
            "    try: fxmem.cli.main(['--version'])\n"
            "    except SystemExit: pass\n"
            "print(out.getvalue().strip(), 'torch' in sys.modules, 'sympy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    # the version is read from the installed package's metadata (no import): a CUDA wheel's metadata
    # may drop the local tag that torch.__version__ carries ("2.14.1" for "2.14.1+cu130")
    from importlib.metadata import version
    assert out.stdout.split() == ["fxmem", fxmem.__version__, "(torch", f"{version('torch')})", "False", "False"]
    assert torch.__version__.startswith(version("torch"))
    help_text = run("analyze", "--help").stdout
    for option in ("--input", "--hints", "--init", "--dtype", "--mode", "--optimizer", "--eval", "--json", "--dims",
                   "--device", "--no-grad", "--lines", "--modules", "--diagram", "--timeline", "--group"):
        assert option in help_text
    # every option has a help text: argparse prints a bare option line otherwise
    parser = fxmem.cli.build_parser()
    for sub in parser._subparsers._group_actions[0].choices.values():
        assert all(a.help for a in sub._actions), [a.dest for a in sub._actions if not a.help]


def test_package_module_targets_and_progress_on_stderr():
    out = run("analyze", "torch.nn:Linear", "--init", "in_features=6,out_features=128", "--input", "B,6",
              "--dims", "B=4")
    assert out.returncode == 0, out.stderr
    report = fxmem.analyze(torch.nn.Linear(6, 128), ("B", 6))
    assert f"peak            = {report.peak}" in out.stdout
    assert "tracing Linear" in out.stderr and "simulating Linear" in out.stderr  # progress, not on stdout
    assert "fxmem: [" not in out.stdout
    out = run("analyze", "torch.nn:Linear", "--input", "B,6")
    assert out.returncode == 2 and "--init" in out.stderr and "in_features" in out.stderr
    out = run("analyze", "no_such_package.mod:Net", "--input", "B,6")
    assert out.returncode == 2 and "no importable module 'no_such_package.mod'" in out.stderr


def test_dtype_converts_the_model_too():
    out = run("analyze", "examples/seed_attention.py:Attention", "--init", "dim=64,num_heads=4", "--input", "B,L,64",
              "--dtype", "bfloat16", "--dims", "B=2,L=8", "--json", "--quiet")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    model = load_example("seed_attention").Attention(64, 4).to(torch.bfloat16)
    report = fxmem.analyze(model, ("B", "L", 64), dtype=torch.bfloat16)
    assert data["formulas"]["resident"] == str(report.resident)
    params = sum(p.numel() for p in model.parameters())
    assert report.at(report.resident, B=2, L=8) == 2 * (params + 2 * 8 * 64)  # 2 bytes each: weights and input
    assert out.stderr == ""  # --quiet


def test_stderr_is_clean_for_a_cnn_without_numpy(tmp_path):
    # calibrating oneDNN convolutions runs the profiler dozens of times; its native start/stop
    # lines and torch's "Failed to initialize NumPy" warning must not reach the user
    (tmp_path / "cnn.py").write_text(
        "import torch.nn as nn\n"
        "class CNN(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.c1, self.b1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)\n"
        "    def forward(self, x):\n"
        "        return self.b1(self.c1(x)).relu()\n")
    code = ("import sys, runpy; sys.modules['numpy'] = None\n"  # as if numpy were not installed
            f"sys.argv = ['fxmem', 'analyze', {str(tmp_path / 'cnn.py:CNN')!r}, '--input', 'B,3,H,W', '--quiet']\n"
            "runpy.run_module('fxmem', run_name='__main__')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr
    assert "peak" in out.stdout
    assert out.stderr == ""


def test_modules_table():
    out = run("analyze", "examples/seed_attention.py:Attention", "--init", "dim=64,num_heads=4", "--input", "B,L,64",
              "--dims", "B=3,L=7", "--modules", "--quiet")
    assert out.returncode == 0, out.stderr
    report = fxmem.analyze(load_example("seed_attention").Attention(64, 4), ("B", "L", 64))
    assert str(report.modules(dict(B=3, L=7))) in out.stdout
