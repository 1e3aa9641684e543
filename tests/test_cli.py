"""The command line prints the same formulas and numbers as the API."""
from __future__ import annotations

import json
import subprocess
import sys

import fxmem
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
