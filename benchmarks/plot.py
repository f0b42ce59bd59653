"""The daemon benchmark's picture: latency vs tap size, throughput vs concurrent clients.

Called by :mod:`benchmarks.bench_daemon`; also redraws from a saved result:
``.venv/bin/python -m benchmarks.plot benchmarks/results/daemon.json``. Needs matplotlib.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = result["sizes"]
    rows = [result["by_size"][str(s)] for s in sizes]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))

    def series(key: str, stat: str) -> list[float]:
        return [r["one_client"][key][stat] for r in rows]

    left.plot(sizes, series("route", "p50_ms"), "o-", color="C0", label="route p50 (HTTP, daemon)")
    left.plot(sizes, series("route", "p99_ms"), "o--", color="C0", alpha=0.6, label="route p99")
    left.plot(sizes, series("encode", "p50_ms"), "s-", color="C2", label="bare ONNX encode p50")
    left.plot(sizes, [r["one_client"]["encode"]["p50_ms"] + r["scoring"]["anchor_brute"]["p50_ms"] for r in rows],
              "^:", color="C3", label="in-process anchor rule p50 (encode + brute scoring)")
    left.plot(sizes, [1.3 * r["one_client"]["encode"]["p50_ms"] for r in rows], color="grey", lw=0.8, ls="-.",
              label="target: 1.3x bare encode")
    left.set_xscale("log")
    left.set_xticks(sizes, [f"{s:,}" for s in sizes])
    left.set_xlabel("capabilities in the tap")
    left.set_ylabel("ms, one client")
    left.set_ylim(bottom=0)
    left.set_title("Route latency vs tap size")
    left.legend(fontsize=8)
    left.grid(alpha=0.3)

    clients = [int(c) for c in rows[0]["throughput"]]
    for number, (size, row) in enumerate(zip(sizes, rows, strict=True)):
        colour = f"C{number}"
        right.plot(clients, [row["throughput"][str(c)]["requests_per_s"] for c in clients], "o-", color=colour,
                   label=f"{size:,} capabilities")
        if "encoder_rates" in row:
            right.axhline(row["encoder_rates"]["batch32_per_s"], color=colour, lw=0.8, ls=":")
        right.plot([clients[-1]], [4 * row["throughput"][str(clients[0])]["requests_per_s"]], "x", color=colour,
                   markersize=9)
    right.plot([], [], "x", color="grey", label=f"target at {clients[-1]}: 4x one client")
    right.plot([], [], ":", color="grey", label="bare encoder, batches of 32, in process")
    right.set_xscale("log", base=2)
    right.set_xticks(clients, [str(c) for c in clients])
    right.set_xlabel("concurrent clients")
    right.set_ylabel("route requests / s")
    right.set_ylim(bottom=0)
    right.set_title("Throughput vs concurrent clients")
    right.legend(fontsize=8)
    right.grid(alpha=0.3)

    fig.suptitle(f"capd daemon on {result['machine']} (load average {result['load_before'][0]} at start): "
                 f"{result['command']}", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    source = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent / "results" / "daemon.json"
    plot(json.loads(source.read_text(encoding="utf-8")), source.with_suffix(".png"))


if __name__ == "__main__":
    main()
