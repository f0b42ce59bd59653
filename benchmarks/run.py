"""Run every ``benchmarks/bench_*.py`` module's ``main()`` in turn, then the routing-quality
report ``benchmarks.quality.run`` (``make bench``).

Each benchmark runs in a fresh interpreter, so that one cannot warm caches, load modules or
leave threads behind for the next. Results land in ``benchmarks/results/``. A failing
benchmark is reported and the others still run; the exit status is 1 if any failed.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path


def main() -> int:
    here = Path(__file__).resolve().parent
    failed = []
    names = [f"benchmarks.{path.stem}" for path in sorted(here.glob("bench_*.py"))] + ["benchmarks.quality.run"]
    for name in names:
        print(f"== {name}", flush=True)
        started = time.perf_counter()
        code = subprocess.call([sys.executable, "-c", f"import {name} as bench; bench.main()"], cwd=here.parent)
        if code != 0:
            failed.append(name)
        print(f"== {name}: {time.perf_counter() - started:.1f} s{'' if code == 0 else f', exit {code}'}", flush=True)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
