"""Regenerate the pictures in docs/ (the README shows them). Needs graphviz's `dot`.

    python docs/make_images.py

* ``seed_gat_diagram.png``   - seed 000's GAT layer at the blog's B=4, N=500: what each node
  allocates (fill) and keeps for backward (blue rows), the live bytes (grey gauges), the peak
  (``cat``) with its formula;
* ``seed_gat_formulas.png``  - the same diagram without sizes: formulas only, nothing coloured by size;
* ``seed_gat_timeline.png``  - the same layer's tensors over time at B=4, N=500 (matplotlib);
* ``transformer12_modules.png`` - the 12-block transformer of ``benchmarks/analyze_speed.py``,
  one box per block (``group="module"``), at B=8, L=512.
"""
from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
sys.path.insert(0, os.path.join(HERE, "..", "benchmarks"))


def main() -> None:
    import fxmem
    from analyze_speed import Stack
    from seed_gat import GraphAttentionLayer

    layer = fxmem.analyze(GraphAttentionLayer(6, 128), ("B", "N", 6), ("B", "N", "N"))
    written = [layer.render(os.path.join(HERE, "seed_gat_diagram.png"), dims=dict(B=4, N=500)),
               layer.render(os.path.join(HERE, "seed_gat_formulas.png")),
               layer.render(os.path.join(HERE, "seed_gat_timeline.png"), what="timeline", dims=dict(B=4, N=500))]
    stack = fxmem.analyze(Stack(), ("B", "L", 768))
    written.append(stack.render(os.path.join(HERE, "transformer12_modules.png"), dims=dict(B=8, L=512), group="module"))
    for path in written:
        print(f"wrote {os.path.relpath(path)} ({os.path.getsize(path):,} bytes)")


if __name__ == "__main__":
    main()
