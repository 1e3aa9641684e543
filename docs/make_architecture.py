"""Draw fxmem's pipeline from its own imports: ``docs/architecture.dot`` and ``docs/architecture.svg``.

    python docs/make_architecture.py          # rewrite both (needs graphviz's `dot` for the SVG)
    python docs/make_architecture.py --check  # exit 1 if the committed DOT no longer matches the code

Every module of ``fxmem/`` and ``passes/`` (installed as ``fxmem.passes``) belongs to one stage
(``STAGES`` below: a folder is its own stage, a top-level module is placed by name). An arrow
``B -> A`` says some module of stage A imports one of stage B: B flows into A (a dashed arrow: only
inside a function, imported when it runs; red: the two stages import each other); its label
counts the importing modules. The foundation
(errors, units, parsing, records, the private-torch layer) is imported from everywhere, so its
arrows are left out and it is drawn at the bottom. ``tests/package/test_architecture.py`` regenerates the
DOT and compares it with the committed one, so the picture cannot drift from the code: a new
top-level module must be given a stage here, and a new import across stages shows as an arrow.

The same reading answers two questions the tests ask of the tree: whether any modules import
each other in a circle (:func:`import_cycles`), and which modules are over the size limit
(:func:`long_modules`).
"""
from __future__ import annotations

import argparse
import ast
import pathlib
import shutil
import subprocess
import sys
from collections import defaultdict

ROOT = pathlib.Path(__file__).resolve().parents[1]

# stage: (what it does, for the picture; the top-level modules of fxmem/ in it). A folder of fxmem/
# is the stage of the same name; passes/ is "passes".
STAGES = {
    "entry points": ("what users call", ["__init__", "__main__", "analyze", "validate", "precisions", "llm",
                                          "llm_stages", "llm_layouts", "generation", "recipes", "cli", "backend"]),
    "inputs": ("options, hyperparameters, real inputs", ["options", "hparams", "inputs"]),
    "capture": ("model -> graph (fx, Dynamo) or eager lines", []),
    "simulation": ("one fake run with symbolic sizes: every storage", ["training"]),
    "kernels": ("what real kernels allocate beyond outputs", []),
    "ops": ("fxmem's own fused operators", []),
    "accounting": ("events -> formulas, regions, budgets", []),
    "report": ("Report: formulas, evaluate, the self-check", ["report", "selfcheck"]),
    "views": ("tables, diagrams, timelines, HTML", []),
    "distributed": ("ranks: FSDP2, DDP, world sizes", []),
    "passes": ("fxmem.optimize: rewrites, each verified", []),
    "foundation": ("vocabulary and torch's internals, imported everywhere",
                   ["errors", "units", "search", "parsing", "records", "specs", "progress", "data_paths", "caches", "isolation",
                    "timeout", "measure", "output_strides", "view_strides", "_layout", "_torch_compat"]),
}
SPINE = ("inputs", "capture", "simulation", "accounting", "views", "report", "entry points")
LIMIT = 800  # lines; a longer module is a catalogue (data) or is named in ALLOWED_LONG with its reason
ALLOWED_LONG = {
    "passes/optimize.py": "the rewrite driver; splitting it is part of the optimize issue (driver, decisions, trials)",
}


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] == "passes":
        parts = ["fxmem", "passes"] + parts[1:]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def modules() -> dict[str, pathlib.Path]:
    """``{"fxmem.simulation.simulate": path, ...}`` for every module of fxmem/ and passes/."""
    files = sorted(ROOT.glob("fxmem/**/*.py")) + sorted(ROOT.glob("passes/*.py"))
    return {_module_name(p): p for p in files if "__pycache__" not in p.parts}


def imports() -> dict[tuple[str, str], bool]:
    """``{(importer, imported): at_top}`` between fxmem's modules (``at_top``: at module level)."""
    mods = modules()
    edges: dict[tuple[str, str], bool] = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[:len(package.split(".")) - node.level + 1]
                    prefix = ".".join(base + ([node.module] if node.module else []))
                else:
                    prefix = node.module or ""
                targets = [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in mods else prefix for a in node.names]
            else:
                continue
            for target in targets:
                while target and target not in mods:  # a name inside a module: the module
                    target = target.rpartition(".")[0]
                if target and target != name:
                    top = node.col_offset == 0
                    edges[(name, target)] = edges.get((name, target), False) or top
    return edges


def stage(module: str) -> str:
    """The stage of one module (``KeyError`` for a top-level module no stage names)."""
    parts = module.split(".")
    short = parts[1] if len(parts) > 1 else "__init__"
    if short in STAGES:  # a folder: capture, simulation, ..., passes
        return short
    for name, (_, members) in STAGES.items():
        if short in members:
            return name
    raise KeyError(f"{module} has no stage: add it to STAGES in docs/make_architecture.py")


def unplaced() -> list[str]:
    """Modules no stage holds (each must be placed, so the picture stays whole)."""
    out = []
    for module in modules():
        try:
            stage(module)
        except KeyError:
            out.append(module)
    return out


def import_cycles() -> list[list[str]]:
    """Groups of modules that import each other in a circle (at module level or inside functions)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for a, b in imports():
        graph[a].add(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(modules()):
        if v not in index:
            visit(v)
    return found


def long_modules() -> dict[str, int]:
    """``{path: lines}`` of modules over ``LIMIT`` lines that are neither catalogues nor allowed."""
    out = {}
    for path in modules().values():
        rel = path.relative_to(ROOT).as_posix()
        lines = len(path.read_text().splitlines())
        if lines > LIMIT and rel not in ALLOWED_LONG:
            out[rel] = lines
    return out


def dot_text() -> str:
    """The picture as graphviz DOT (deterministic: sorted, no sizes that change with a line)."""
    edges: dict[tuple[str, str], dict] = {}
    for (a, b), top in imports().items():
        sa, sb = stage(a), stage(b)
        if sa == sb or sb == "foundation":
            continue
        e = edges.setdefault((sa, sb), {"importers": set(), "top": False})
        e["importers"].add(a)
        e["top"] |= top
    members: dict[str, int] = defaultdict(int)
    for module in modules():
        members[stage(module)] += 1
    lines = ["// generated by docs/make_architecture.py from fxmem's imports; do not edit",
             "digraph fxmem {", '  rankdir=TB; nodesep=0.35; ranksep=0.45;',
             '  node [shape=box, style="rounded,filled", fillcolor="#f4f4f4", fontname="Helvetica", fontsize=11];',
             '  edge [color="#777777", fontname="Helvetica", fontsize=9];']
    for name, (what, _) in STAGES.items():
        fill = "#dbe9f6" if name in SPINE else ("#eeeeee" if name == "foundation" else "#f4f4f4")
        lines.append(f'  "{name}" [label="{name}\\n{what}\\n({members[name]} modules)", fillcolor="{fill}"];')
    for a, b in zip(SPINE, SPINE[1:]):
        lines.append(f'  "{a}" -> "{b}" [style=invis, weight=10];')  # keeps the spine a column
    for (a, b), e in sorted(edges.items(), key=lambda item: (item[0][1], item[0][0])):
        style = "solid" if e["top"] else "dashed"
        # drawn from the imported stage to the importer: what a stage builds on flows into it, so
        # the spine reads top-down; red where two stages import each other (a knot to untie)
        colour = ', color="#c0392b", fontcolor="#c0392b"' if (b, a) in edges else ""
        lines.append(f'  "{b}" -> "{a}" [label="{len(e["importers"])}", style={style}{colour}];')
    lines.append('  { rank=source; "foundation"; }')
    lines.append("}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare the committed DOT with the code")
    args = parser.parse_args(argv)
    dot_path = ROOT / "docs" / "architecture.dot"
    text = dot_text()
    if args.check:
        same = dot_path.exists() and dot_path.read_text() == text
        print("docs/architecture.dot matches the code" if same else
              "docs/architecture.dot is out of date: run python docs/make_architecture.py")
        return 0 if same else 1
    dot_path.write_text(text)
    print(f"wrote {dot_path.relative_to(ROOT)}")
    if shutil.which("dot") is None:
        print("graphviz's dot is not installed: the SVG was not redrawn", file=sys.stderr)
        return 1
    svg = ROOT / "docs" / "architecture.svg"
    subprocess.run(["dot", "-Tsvg", str(dot_path), "-o", str(svg)], check=True)
    print(f"wrote {svg.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
