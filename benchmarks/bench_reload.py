"""Tap reload benchmark: writes benchmarks/results/reload.json and reload.md.

What a live reload costs in the tap loader alone (:class:`capd.live_taps.LiveTaps`, no model), on
the generated 1,000-capability tap (``benchmarks/.cache``, written on first use): a full rescan,
and a reload for 1, 100, 2,000 and every changed file (spread evenly over the tap's folders),
each as a ratio of the full rescan. A checkout or
``git pull`` hands the watcher thousands of changed paths at once; a reload for them must not
cost much more than reading the whole tap again (2,000 paths cost 98 times that before 2026-11-27).

Run: ``.venv/bin/python -m benchmarks.bench_reload`` (about 10 s).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks import gen_tap
from capd.live_taps import LiveTaps

RESULTS = Path(__file__).resolve().parent / "results"
CACHE = Path(__file__).resolve().parent / ".cache"
SIZE = 1_000
CHANGED = (1, 100, 2_000, 0)  # 0: every file
REPEATS = 5


def _seconds(live: LiveTaps, changed: list[Path] | None) -> float:
    """The median of :data:`REPEATS` loads, after one that warms the file-system cache."""
    live.load(changed)
    times = []
    for _ in range(REPEATS):
        started = time.perf_counter()
        live.load(changed)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> dict[str, Any]:
    tap = gen_tap.cached_tap(SIZE, CACHE).absolute()
    files = sorted(tap.glob("capabilities/*/*.toml"))
    live = LiveTaps([tap])
    live.load()
    full = _seconds(live, None)
    rows = []
    for count in (c or len(files) for c in CHANGED):
        changed = [files[i * len(files) // count] for i in range(count)]  # spread over the tap, as a checkout's are
        seconds = _seconds(live, changed)
        rows.append({"changed_paths": len(changed), "folders": len({p.parent for p in changed}),
                     "seconds": round(seconds, 4), "over_full_rescan": round(seconds / full, 3)})
    result = {"command": ".venv/bin/python -m benchmarks.bench_reload", "machine": f"{os.cpu_count()} CPUs",
              "capabilities": SIZE, "files": len(files), "full_rescan_s": round(full, 4), "reloads": rows}
    lines = [f"# Tap reload ({SIZE:,} capabilities, {len(files):,} files; `{result['command']}`)", "",
             f"Full rescan: {full:.3f} s (median of {REPEATS}).", "",
             "| changed paths | folders | reload | / full rescan |", "|---|---|---|---|"]
    lines += [f"| {r['changed_paths']:,} | {r['folders']:,} | {r['seconds']:.3f} s | {r['over_full_rescan']}x |"
              for r in rows]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "reload.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    (RESULTS / "reload.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))
    return result


if __name__ == "__main__":
    main()
