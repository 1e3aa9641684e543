"""Where ``fxmem.passes`` comes from.

The rewrite passes live in the source tree's top-level ``passes/`` folder and are installed as
``fxmem.passes`` (``pip install .`` copies them into the package; ``pip install -e .`` maps them).
When fxmem is imported straight from a source checkout that ``fxmem.passes`` is not mapped into
(say, a non-editable install shadowed by the checkout's own ``fxmem/``), the folder next to the
package is loaded under that name, so the checkout works as installed. Nothing else is searched:
no top-level module called ``passes`` is ever importable.
"""
from __future__ import annotations

import importlib.util
import os
import sys


def ensure_passes() -> None:
    """Make ``import fxmem.passes`` work (a no-op where the installation already provides it)."""
    if "fxmem.passes" in sys.modules or importlib.util.find_spec("fxmem.passes") is not None:
        return
    folder = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "passes")
    init = os.path.join(folder, "__init__.py")
    if not os.path.exists(init):
        return  # an installation without the passes: ``import fxmem.passes`` says so itself
    spec = importlib.util.spec_from_file_location("fxmem.passes", init, submodule_search_locations=[folder])
    module = importlib.util.module_from_spec(spec)
    sys.modules["fxmem.passes"] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules["fxmem.passes"]
        raise
    setattr(sys.modules["fxmem"], "passes", module)  # as the import system does for a submodule
