"""One options object: defined once, checked once, kept on the report, honoured by re-analyses;
and the package's modules import each other without a cycle."""
from __future__ import annotations

import ast
import pathlib

import networkx as nx
import pytest
import torch

import fxmem
from fxmem.measure import measure

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_unknown_option_is_refused_with_the_closest_name():
    with pytest.raises(fxmem.SpecError, match="did you mean optimizer="):
        fxmem.analyze(torch.nn.Linear(3, 4), ("B", 3), optimiser=None)
    with pytest.raises(fxmem.SpecError, match="did you mean hints="):
        fxmem.optimize(torch.nn.Linear(3, 4), ("B", 3), hint={"B": 5})
    with pytest.raises(fxmem.SpecError, match="options= must be"):
        fxmem.analyze(torch.nn.Linear(3, 4), ("B", 3), options={"grad": False})


def test_report_keeps_its_options_and_they_reproduce_it():
    sgd = lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)  # noqa: E731
    model = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.GELU(), torch.nn.Linear(16, 3))
    report = fxmem.analyze(model, ("B", 5), optimizer=sgd, hints={"B": 7})
    assert report.options.optimizer is sgd and report.options.hints == {"B": 7} and report.model is model
    again = fxmem.analyze(model, *report.input_specs, options=report.options)
    assert str(again.train_peak) == str(report.train_peak) and str(again.peak) == str(report.peak)
    # a keyword changes the options it is given: inference memory, measured on a real run
    inference = fxmem.analyze(model, ("B", 5), options=report.options.replace(optimizer=None), grad=False)
    x = torch.randn(11, 5)
    with torch.no_grad():
        m = measure(lambda: model(x))
    assert m.peak_above_start == inference.evaluate(B=11)["peak_above_resident"]


def _imports(path: pathlib.Path, package: str) -> set[str]:
    """Every fxmem module ``path`` imports (top level or inside a function)."""
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            names = [mod] + [f"{mod}.{a.name}" for a in node.names]
            out |= {n for n in names if n.startswith("fxmem")}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("fxmem")}
    return out


def test_no_import_cycle_between_the_analysis_and_the_passes():
    """The analysis (analyze, report, simulation, accounting, views ...) never imports the
    rewrites (passes/, installed as fxmem.passes): the passes build on the analysis; only the
    entry points above both (fxmem.validate checks a rewrite) import them."""
    graph = nx.DiGraph()
    files = {}
    for path in (ROOT / "fxmem").rglob("*.py"):
        rel = path.relative_to(ROOT).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        files[name] = (path, name if rel.name == "__init__" else name.rpartition(".")[0])
    for path in (ROOT / "passes").glob("*.py"):
        name = "fxmem.passes" if path.stem == "__init__" else f"fxmem.passes.{path.stem}"
        files[name] = (path, "fxmem.passes")
    for name, (path, package) in files.items():
        for target in _imports(path, package):
            while target and target not in files:
                target = target.rpartition(".")[0]
            if target and target != name and target != "fxmem":
                graph.add_edge(name, target)
    analysis = [n for n in graph if not n.startswith("fxmem.passes") and n != "fxmem.validate"]
    wrong = sorted((a, b) for a, b in graph.edges if a in analysis and b.startswith("fxmem.passes"))
    assert not wrong, f"the analysis imports the passes: {wrong}"
    cycles = [c for c in nx.simple_cycles(graph) if any(n.startswith("fxmem.passes") for n in c)
              and any(not n.startswith("fxmem.passes") for n in c)]
    assert not cycles, cycles


def test_the_options_reach_the_simulation_as_one_object(monkeypatch):
    """``simulate(target, specs, options, symbols)``: the options travel down as one value (the mode
    and the sizes resolved for the run), so a new option is a field plus the code that reads it."""
    import inspect
    import sys

    from fxmem.options import AnalysisOptions

    simulation = sys.modules["fxmem.simulation.simulate"]
    for fn in (simulation.simulate, simulation.simulate_once):
        loose = set(inspect.signature(fn).parameters) & set(AnalysisOptions.names())
        assert not loose, f"{fn.__name__} takes options as loose parameters: {sorted(loose)}"
    seen = []
    once = simulation.simulate_once

    def captured(model, specs, options, symbols, **given):
        seen.append(options)
        return once(model, specs, options, symbols, **given)

    monkeypatch.setattr(simulation, "simulate_once", captured)
    analyze_module = sys.modules["fxmem.analyze"]
    assert analyze_module.simulate is simulation.simulate  # (the analysis calls it; it calls simulate_once)
    model = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.GELU(), torch.nn.Linear(16, 3))
    report = fxmem.analyze(model, ("B", 5), autocast=torch.bfloat16, repeats=False, hints={"B": 8},
                           leaf_modules=[torch.nn.GELU], grad=False, check=False)
    assert seen and all(isinstance(o, AnalysisOptions) for o in seen)
    opts = seen[0]
    assert opts.autocast is torch.bfloat16 and opts.repeats is False and opts.grad is False
    assert opts.hints == {"B": 8} and opts.leaf_modules == (torch.nn.GELU,)
    assert opts.mode == "graph"  # "auto", resolved by the analysis for this run
    assert report.options.mode == "auto" and report.options.hints == {"B": 8}  # the user's, as given
    assert report.peak.free_symbols  # a formula in B
