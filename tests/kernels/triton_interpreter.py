"""What the Triton kernels' tests share: Triton's interpreter (``TRITON_INTERPRET=1``), which runs
their kernels on CPU tensors. Import this module before Triton (it sets the variable): Triton reads
it when it jits a kernel, its own library's (``tl.zeros`` ...) included. Its fixture is imported by name."""
from __future__ import annotations

import os

import pytest

os.environ["TRITON_INTERPRET"] = "1"

WHY = "Triton was imported before tests/kernels/triton_interpreter.py set TRITON_INTERPRET=1: run it alone"


def interpreted() -> bool:
    """Whether Triton runs its kernels interpreted in this process (imported after the setting)."""
    import triton.language as tl
    return type(tl.zeros).__name__ == "InterpretedFunction"


@pytest.fixture
def triton_interpreter(request: pytest.FixtureRequest) -> bool:
    """Whether the interpreter runs; skips a test that needs it where Triton was imported without it
    (no GPU here runs the compiled kernels) - but ``test_triton_runs_interpreted``, which fails then."""
    running = interpreted()
    if not running and request.node.name != "test_triton_runs_interpreted":
        pytest.skip(WHY)
    return running
