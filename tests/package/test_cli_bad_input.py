"""Bad input through the command line: every case exits with code 2 and one paragraph on stderr
(never a traceback), argument errors are found before any analysis starts, and no string given on
the command line is executed."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SEED = str(ROOT / "examples" / "seed_gat.py") + ":GraphAttentionLayer"
GOOD = ["--input", "B,N,6", "--input", "B,N,N"]


def fxmem_cli(*args: str, cwd: pathlib.Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "FXMEM_TRACEBACK"}
    return subprocess.run([sys.executable, "-m", "fxmem", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env=env)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> pathlib.Path:
    d = tmp_path_factory.mktemp("models")
    (d / "broken.py").write_text("import torch\nclass M(torch.nn.Module):\n    def forward(self, x)\n        return x\n")
    (d / "raises.py").write_text("import torch\nraise RuntimeError('no GPU here')\n")
    (d / "needs_args.py").write_text("import torch\nclass M(torch.nn.Module):\n    def __init__(self, width):\n"
                                     "        super().__init__()\n        self.l = torch.nn.Linear(width, 2)\n"
                                     "    def forward(self, x):\n        return self.l(x)\n"
                                     "class Picky(M):\n    def __init__(self, width):\n"
                                     "        if width < 0: raise ValueError('width must be >= 0')\n"
                                     "        super().__init__(width)\n")
    (d / "readonly").mkdir()
    os.chmod(d / "readonly", 0o500)
    return d


CASES = [
    ("missing file", ["analyze", "nope.py:M", *GOOD], ["does not exist"]),
    ("no class name", ["analyze", SEED.split(":")[0], *GOOD], ["expected path/to/file.py:ClassOrFactory"]),
    ("unknown class", ["analyze", SEED + "X", *GOOD], ["has no 'GraphAttentionLayerX'"]),
    ("syntax error in the model file", ["analyze", "{d}/broken.py:M", "--input", "B,6"], ["syntax error at line 3"]),
    ("the model file raises", ["analyze", "{d}/raises.py:M", "--input", "B,6"], ["importing", "no GPU here", "raises.py:2"]),
    ("constructor needs arguments", ["analyze", "{d}/needs_args.py:M", "--input", "B,6"], ["width", "--init"]),
    ("constructor refuses them", ["analyze", "{d}/needs_args.py:Picky", "--init", "width=-1", "--input", "B,6"],
     ["width must be >= 0", "needs_args.py:10"]),
    ("unknown module", ["analyze", "no_such_package.models:M", "--input", "B,6"], ["no importable module"]),
    ("init code", ["analyze", "{d}/needs_args.py:M", "--init", "width=__import__('os').system('touch pwned')",
                   "--input", "B,6"], ["Python literal"]),
    ("init a set", ["analyze", "{d}/needs_args.py:M", "--init", "width={1}", "--input", "B,6"], ["only numbers"]),
    ("init unbalanced", ["analyze", "{d}/needs_args.py:M", "--init", "width=(6", "--input", "B,6"], ["unbalanced"]),
    ("init no value", ["analyze", "{d}/needs_args.py:M", "--init", "width", "--input", "B,6"], ["NAME=VALUE"]),
    ("input code", ["analyze", SEED, "--input", "B,N,__import__('os').system('touch pwned')", "--input", "B,N,N"],
     ["function call"]),
    ("input power tower", ["analyze", SEED, "--input", "B,N,9**9**9", "--input", "B,N,N"], ["exponent"]),
    ("input empty dim", ["analyze", SEED, "--input", "B,,6", "--input", "B,N,N"], ["empty dim"]),
    ("input bad dtype", ["analyze", SEED, "--input", "B,N,6:float33", "--input", "B,N,N"], ["unknown dtype"]),
    ("input dtype attribute", ["analyze", SEED, "--input", "B,N,6:__class__", "--input", "B,N,N"], ["unknown dtype"]),
    ("input negative", ["analyze", SEED, "--input", "B,N,-6", "--input", "B,N,N"], ["negative"]),
    ("too few inputs", ["analyze", SEED, "--input", "B,N,6"], ["got 1 input spec"]),
    ("dims not numbers", ["analyze", SEED, *GOOD, "--dims", "B=four,N=5"], ["not a whole number"]),
    ("dims zero", ["analyze", SEED, *GOOD, "--dims", "B=0,N=5"], ["at least 1"]),
    ("dims unknown", ["analyze", SEED, *GOOD, "--dims", "B=4,N=5,Q=3"], ["unknown dim(s) ['Q']"]),
    ("dims missing", ["analyze", SEED, *GOOD, "--dims", "B=4"], ["missing dim(s) ['N']"]),
    ("dims code", ["analyze", SEED, *GOOD, "--dims", "B=__import__('os').getpid(),N=5"], ["not a whole number"]),
    ("dims huge", ["analyze", SEED, *GOOD, "--dims", "B=99999999999999999999,N=5"], ["not a whole number"]),
    ("hints unknown", ["analyze", SEED, *GOOD, "--hints", "Q=3"], ["--hints: unknown dim(s) ['Q']"]),
    ("hints negative", ["analyze", SEED, *GOOD, "--hints", "B=-3"], ["must be at least 0"]),
    ("diagram extension", ["analyze", SEED, *GOOD, "--diagram", "out.docx"], [".svg"]),
    ("diagram folder missing", ["analyze", SEED, *GOOD, "--diagram", "no/such/folder/out.svg"], ["does not exist"]),
    ("diagram not writable", ["analyze", SEED, *GOOD, "--diagram", "{d}/readonly/out.svg"], ["cannot write"]),
    ("diagram into a device", ["analyze", SEED, *GOOD, "--diagram", "/dev/full.svg"], ["system folder"]),
    ("input with 5000 dims", ["analyze", "torch.nn:ReLU", "--input", ",".join(["B"] + ["1"] * 4999)], ["at most 64"]),
    ("timeline without dims", ["analyze", SEED, *GOOD, "--timeline", "t.png"], ["--dims"]),
    ("validate negative tolerance", ["validate", SEED, *GOOD, "--dims", "B=2,N=3", "--device", "cpu",
                                     "--tolerance", "-1"], ["number >= 0"]),
    ("validate nan tolerance", ["validate", SEED, *GOOD, "--dims", "B=2,N=3", "--device", "cpu",
                                "--tolerance", "nan"], ["number >= 0"]),
    ("unknown option", ["analyze", SEED, *GOOD, "--frobnicate"], ["unrecognized arguments"]),
    ("unknown command", ["profile", SEED], ["invalid choice"]),
    ("bad dtype option", ["analyze", SEED, *GOOD, "--dtype", "int8"], ["invalid choice"]),
    ("cuda on a CPU build", ["analyze", SEED, *GOOD, "--device", "cuda"], ["cuda"]),
]


@pytest.mark.parametrize("label, args, fragments", CASES, ids=[c[0] for c in CASES])
def test_cli_bad_input_is_one_paragraph_and_exit_code_2(label, args, fragments, files, tmp_path):
    if label == "cuda on a CPU build":
        import torch

        if torch.backends.cuda.is_built():
            pytest.skip("this torch is a CUDA build: simulating CUDA works here")
    if label == "diagram not writable" and os.geteuid() == 0:
        pytest.skip("root writes anywhere")
    out = fxmem_cli(*[a.replace("{d}", str(files)) for a in args], cwd=tmp_path)
    assert out.returncode == 2, (out.returncode, out.stdout[-500:], out.stderr[-2000:])
    err = out.stderr
    assert "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in err, f"{fragment!r} not in: {err}"
    assert "] simulating" not in err, f"an argument error must stop before the analysis: {err}"
    assert not (tmp_path / "pwned").exists()


TINY_LLAMA = ('{"model_type": "llama", "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, '
              '"intermediate_size": 32, "vocab_size": 32}')


@pytest.mark.parametrize("gpu", [["--gpu", "-1GiB"], ["--gpu=-1GiB"], ["--gpu", "-5"], ["--gpu", "lots"]])
def test_llm_gpu_that_is_not_a_positive_amount_names_the_option(gpu, tmp_path):
    # '--gpu -1GiB' reaches fxmem's own check (argparse alone reads '-1GiB' as an option)
    (tmp_path / "config.json").write_text(TINY_LLAMA)
    out = fxmem_cli("llm", "config.json", "--seq", "4", *gpu, cwd=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "--gpu" in out.stderr and "positive number of bytes" in out.stderr, out.stderr
    assert "expected one argument" not in out.stderr and "importing torch" not in out.stderr


def test_snapshot_without_dims_is_refused_before_the_analysis(tmp_path):
    out = fxmem_cli("analyze", SEED, *GOOD, "--snapshot", "s.pickle", cwd=tmp_path)
    assert out.returncode == 2 and "--snapshot" in out.stderr and "--dims" in out.stderr, out.stderr[-2000:]
    assert "] simulating" not in out.stderr and not (tmp_path / "s.pickle").exists()


def test_llm_quiet_prints_nothing_on_stderr(tmp_path):
    (tmp_path / "config.json").write_text(TINY_LLAMA.replace('"vocab_size"', '"torch_dtype": "float32", "vocab_size"'))
    out = fxmem_cli("llm", "config.json", "--seq", "4", "--quiet", cwd=tmp_path)
    assert out.returncode == 0 and "training step peak" in out.stdout, out.stderr[-2000:]
    assert out.stderr == "", out.stderr  # no progress, no library warning or deprecation line


def test_quiet_silences_library_warnings_and_logging(capfd):
    import logging
    import warnings

    from fxmem.cli import _libraries_quiet

    level, verbosity = logging.getLogger("transformers").level, os.environ.get("TRANSFORMERS_VERBOSITY")
    with _libraries_quiet(True):
        warnings.warn("`torch_dtype` is deprecated! Use `dtype` instead!", FutureWarning)
        logging.getLogger("transformers.configuration_utils").warning("a library's warning")
    assert capfd.readouterr().err == ""
    # the command's settings end with it (main() may run inside a longer process)
    assert logging.getLogger("transformers").level == level and os.environ.get("TRANSFORMERS_VERBOSITY") == verbosity
