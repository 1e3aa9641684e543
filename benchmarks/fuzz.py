"""A long fuzz run: seeded random models against real runs, printing every outcome as it comes.

    python benchmarks/fuzz.py 0 1000          # seeds 0..999; exit status 1 on any silent mismatch

The committed table is benchmarks/exactness.py's (corpus and fuzzer together).
"""
from __future__ import annotations

import collections
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))


def main() -> int:
    from fuzz.generator import generate
    from fuzz.runner import check

    start, stop = (int(a) for a in sys.argv[1:3]) if len(sys.argv) >= 3 else (0, 1000)
    counts: collections.Counter = collections.Counter()
    for seed in range(start, stop):
        case = generate(seed)
        outcome = check(case)
        counts[outcome.status] += 1
        print(f"{seed} {outcome.status} {outcome.detail[:300]}", flush=True)
        if outcome.status == "mismatch":
            print("   " + case.describe(), flush=True)
    total = sum(counts.values())
    print(f"{dict(counts)}; exact {100 * counts['exact'] / max(total, 1):.2f} %", flush=True)
    return 1 if counts["mismatch"] else 0


if __name__ == "__main__":
    sys.exit(main())
