"""``capd eval --html``: one self-contained page (inline SVG and CSS, no network) for tap authors.

It shows where the gates cut: the best-score and margin distributions of right winners,
wrong winners and nulls with the threshold and margin drawn on them; recall per capability;
and the most confused capability pairs.
"""

from __future__ import annotations

from html import escape
from typing import Any

import numpy as np

from capd.evaluation import Outcome, ScoreTable

_COLOURS = {"right winner": "#2e7d32", "wrong winner": "#ef6c00", "null (must abstain)": "#546e7a"}
_W, _H, _PAD = 640, 220, 36


def _histogram(title: str, series: dict[str, np.ndarray], cut: float | None, cut_label: str,
               lo: float, hi: float, bins: int = 40) -> str:
    edges = np.linspace(lo, hi, bins + 1)
    counts = {k: np.histogram(np.clip(v, lo, hi), bins=edges)[0] for k, v in series.items()}
    peak = max([int(c.max()) for c in counts.values() if c.size] + [1])
    plot_w, plot_h = _W - 2 * _PAD, _H - 2 * _PAD
    bar_w = plot_w / bins / max(len(series), 1)
    parts = [f'<svg viewBox="0 0 {_W} {_H}" width="{_W}" height="{_H}" role="img" aria-label="{escape(title)}">',
             f'<rect x="{_PAD}" y="{_PAD}" width="{plot_w}" height="{plot_h}" fill="#fafafa" stroke="#ccc"/>']
    for s_index, (label, count) in enumerate(counts.items()):
        for b_index, value in enumerate(count):
            if not value:
                continue
            height = plot_h * value / peak
            x = _PAD + b_index * plot_w / bins + s_index * bar_w
            parts.append(f'<rect x="{x:.1f}" y="{_PAD + plot_h - height:.1f}" width="{bar_w:.1f}" '
                         f'height="{height:.1f}" fill="{_COLOURS[label]}"><title>{escape(label)}: {value} in '
                         f'[{edges[b_index]:.2f}, {edges[b_index + 1]:.2f})</title></rect>')
    for tick in np.linspace(lo, hi, 6):
        x = _PAD + plot_w * (tick - lo) / (hi - lo)
        parts.append(f'<text x="{x:.1f}" y="{_H - 12}" font-size="11" text-anchor="middle">{tick:.2f}</text>')
    if cut is not None and lo <= cut <= hi:
        x = _PAD + plot_w * (cut - lo) / (hi - lo)
        parts.append(f'<line x1="{x:.1f}" y1="{_PAD - 6}" x2="{x:.1f}" y2="{_PAD + plot_h}" stroke="#c62828" '
                     f'stroke-width="2" stroke-dasharray="5,3"/>'
                     f'<text x="{x + 4:.1f}" y="{_PAD - 10}" font-size="12" fill="#c62828">{escape(cut_label)} '
                     f'{cut:.2f}</text>')
    parts.append(f'<text x="{_PAD}" y="16" font-size="13" font-weight="bold">{escape(title)}</text></svg>')
    return "".join(parts)


def _legend() -> str:
    return "".join(f'<span class="key"><i style="background:{c}"></i>{escape(k)}</span>' for k, c in _COLOURS.items())


def _recall_bars(per_capability: dict[str, dict[str, Any]]) -> str:
    rows = sorted(per_capability.items(), key=lambda item: (item[1]["recall"], item[0]))
    bar_h, label_w, width = 16, 220, _W
    height = bar_h * len(rows) + 10
    parts = [f'<svg viewBox="0 0 {width} {height}" width="{width}" height="{height}" role="img" '
             f'aria-label="recall per capability">']
    for i, (name, entry) in enumerate(rows):
        y = 5 + i * bar_h
        w = (width - label_w - 60) * entry["recall"]
        colour = "#2e7d32" if entry["recall"] >= 0.8 else "#ef6c00" if entry["recall"] >= 0.5 else "#c62828"
        parts.append(f'<text x="{label_w - 6}" y="{y + 12}" font-size="11" text-anchor="end">{escape(name)}</text>'
                     f'<rect x="{label_w}" y="{y + 2}" width="{w:.1f}" height="{bar_h - 4}" fill="{colour}"/>'
                     f'<text x="{label_w + w + 4:.1f}" y="{y + 12}" font-size="11">{entry["recall"]:.2f} '
                     f'(n={entry["n"]})</text>')
    parts.append("</svg>")
    return "".join(parts)


def _metric(value: object) -> str:
    return "n/a" if value is None else f"{value:.3f}" if isinstance(value, float) else escape(str(value))


def render(result: dict[str, Any], table: ScoreTable, outcome: Outcome, title: str) -> str:
    positive = table.positive
    groups = {
        "right winner": positive & outcome.correct,
        "wrong winner": positive & ~outcome.correct,
        "null (must abstain)": ~positive,
    }
    threshold = result.get("threshold")
    margin = result.get("margin")
    fused = result.get("rule") == "fused"  # level and log-odds gap, not cosines
    score_range, margin_range = ((-0.6, 0.4), (0.0, 6.0)) if fused else ((-0.1, 1.0), (0.0, 0.5))
    scores = _histogram("Best score per message", {k: outcome.top1[m] for k, m in groups.items()},
                        threshold if isinstance(threshold, float) else None, "threshold", *score_range)
    margins = _histogram("Margin between best and runner-up", {k: outcome.margin[m] for k, m in groups.items()},
                         margin if isinstance(margin, float) else None, "margin", *margin_range)
    headline = ["top1", "fired_right", "fired_wrong", "null_fpr", "n", "positives", "nulls"]
    metric_rows = "".join(f"<tr><th>{k}</th><td>{_metric(result.get(k))}</td></tr>" for k in headline)
    kinds = "".join(f"<tr><td>{escape(kind)}</td><td>{v['n']}</td><td>{_metric(v['accuracy'])}</td></tr>"
                    for kind, v in result["per_kind"].items())
    confusions = "".join(f"<tr><td>{escape(c['expected'])}</td><td>{escape(c['got'])}</td><td>{c['count']}</td>"
                         f"<td>{c['fired']}</td></tr>" for c in result["confusions"]) \
        or "<tr><td colspan=4>none</td></tr>"
    gates = f"rule {escape(str(result.get('rule')))}, threshold {_metric(threshold)}, margin {_metric(margin)}, " \
            f"top_k {_metric(result.get('top_k'))}"
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>
<style>
body {{ font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #222; max-width: 980px; }}
h1 {{ font-size: 20px; }} h2 {{ font-size: 16px; margin-top: 28px; }}
table {{ border-collapse: collapse; }} td, th {{ border: 1px solid #ddd; padding: 3px 8px; text-align: left; }}
.key {{ margin-right: 14px; }} .key i {{ display: inline-block; width: 12px; height: 12px; margin-right: 4px; }}
.cols {{ display: flex; gap: 32px; flex-wrap: wrap; }}
</style></head><body>
<h1>{escape(title)}</h1>
<p>{gates}</p>
<div class="cols"><table>{metric_rows}</table>
<table><tr><th>kind</th><th>n</th><th>decided right</th></tr>{kinds}</table></div>
<h2>Where the gates cut</h2>
<p>{_legend()}</p>
{scores}
{margins}
<h2>Recall per capability (worst first)</h2>
{_recall_bars(result["per_capability"])}
<h2>Most confused pairs</h2>
<table><tr><th>expected</th><th>router's best</th><th>count</th><th>activated</th></tr>{confusions}</table>
</body></html>
"""
