"""``capd calibrate``: choose gates from fixtures, and say how they hold up on unseen rows.

Every gate parameter the router has is swept: ``top_k`` (1–5), ``threshold`` and
``margin`` (grids below). Fixtures are split deterministically by a hash of the
message — ``HELD_OUT_SHARE`` of them are never used for fitting — and the recommended
point is the one with the most ``fired_right`` on the fitting part whose ``null_fpr`` and
``fired_wrong`` stay within the limits (ties go to the higher threshold, then the higher
margin: the more cautious point). The same point is then reported on the held-out part.

``--write`` stores the point in ``<tap>/capd.toml`` (``[gates]`` plus the model it was fitted
for); capability files are never touched.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from capd.evaluation import ScoreTable, apply_gates, embed_fixtures, metrics, score_table
from capd.fixtures import Fixture
from capd.router import Router

THRESHOLDS = np.round(np.arange(0.0, 1.0001, 0.01), 2)
MARGINS = np.round(np.arange(0.0, 0.3001, 0.005), 3)
TOP_KS = (1, 2, 3, 4, 5)
HELD_OUT_SHARE = 0.3


def split(fixtures: Sequence[Fixture]) -> tuple[np.ndarray, np.ndarray]:
    """(fit rows, held-out rows): stable across runs and machines, independent of file order."""
    held = np.array([int(hashlib.sha256(f.message.encode()).hexdigest()[:8], 16) % 1000 < HELD_OUT_SHARE * 1000
                     for f in fixtures], dtype=bool)
    return np.flatnonzero(~held), np.flatnonzero(held)


@dataclass(frozen=True)
class Point:
    top_k: int
    threshold: float
    margin: float
    fired_right: float
    fired_wrong: float
    null_fpr: float

    def as_dict(self) -> dict[str, float | int]:
        return {"top_k": self.top_k, "threshold": self.threshold, "margin": self.margin,
                "fired_right": self.fired_right, "fired_wrong": self.fired_wrong, "null_fpr": self.null_fpr}


def sweep(table: ScoreTable, top_k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """fired_right, fired_wrong, null_fpr for every (threshold, margin): arrays [T, M]."""
    winner, top1, top2 = table.top2()
    correct = table.expected[np.arange(len(winner)), winner]
    positive = table.positive
    p, n = max(int(positive.sum()), 1), int((~positive).sum())
    gap = top1 - top2
    above = (top1[:, None] >= THRESHOLDS[None, :]) & table.routable[:, None]  # [rows, T]
    wide = gap[:, None] >= MARGINS[None, :]  # [rows, M]
    fired = above[:, :, None] & wide[:, None, :]  # [rows, T, M]
    right = np.tensordot((positive & correct).astype(np.float32), fired, axes=1) / p
    wrong = np.tensordot((positive & ~correct).astype(np.float32), fired, axes=1) / p
    null = np.tensordot((~positive).astype(np.float32), fired, axes=1) / n if n else np.zeros_like(right)
    return right, wrong, null


def best_point(tables: dict[int, ScoreTable], max_null_fpr: float, max_wrong: float) -> tuple[Point | None,
                                                                                             list[Point]]:
    """The recommended point and the operating curve (best point per threshold) over all top_k."""
    best: Point | None = None
    curve: dict[float, Point] = {}
    for top_k, table in tables.items():
        right, wrong, null = sweep(table, top_k)
        ok = (null <= max_null_fpr + 1e-9) & (wrong <= max_wrong + 1e-9)
        score = np.where(ok, right, -1.0)
        for t_index, threshold in enumerate(THRESHOLDS):
            m_index = int(np.argmax(score[t_index]))
            if score[t_index, m_index] < 0:
                continue
            point = Point(top_k, float(threshold), float(MARGINS[m_index]), round(float(right[t_index, m_index]), 4),
                          round(float(wrong[t_index, m_index]), 4), round(float(null[t_index, m_index]), 4))
            current = curve.get(point.threshold)
            if current is None or point.fired_right > current.fired_right:
                curve[point.threshold] = point
            if best is None or (point.fired_right, point.threshold, point.margin) > (best.fired_right,
                                                                                     best.threshold, best.margin):
                best = point
    return best, [curve[t] for t in sorted(curve)]


def calibrate(router: Router, fixtures: Sequence[Fixture], max_null_fpr: float = 0.05,
              max_wrong: float = 0.03) -> dict[str, Any]:
    fit_rows, held_rows = split(fixtures)
    vectors = embed_fixtures(router, fixtures)
    full = {k: score_table(router, fixtures, top_k=k, vectors=vectors) for k in TOP_KS}
    fit = {k: t.subset(fit_rows) for k, t in full.items()}
    point, curve = best_point(fit, max_null_fpr, max_wrong)
    report: dict[str, Any] = {
        "rule": router.rule,
        "limits": {"max_null_fpr": max_null_fpr, "max_wrong": max_wrong},
        "rows": {"fit": len(fit_rows), "held_out": len(held_rows)},
        "recommended": point.as_dict() if point else None,
        "curve": [c.as_dict() for c in curve],
    }
    if point is not None:
        table = full[point.top_k]
        for label, rows in (("fit", fit_rows), ("held_out", held_rows)):
            sub = table.subset(rows)
            report[label] = metrics(sub, apply_gates(sub, point.threshold, point.margin))
    return report


def write_gates(tap: Path, point: dict[str, Any], model: str) -> Path:
    """Store gates in ``<tap>/capd.toml``; only capd's own file is written."""
    path = tap / "capd.toml"
    body = (
        "# Written by `capd calibrate --write`. Gates for this tap's capabilities;\n"
        "# CAPD_THRESHOLD / CAPD_MARGIN / CAPD_TOP_K and flags still override them.\n"
        f'model = "{model}"\n\n'
        "[gates]\n"
        f"threshold = {point['threshold']}\n"
        f"margin = {point['margin']}\n"
        f"top_k = {point['top_k']}\n"
    )
    tmp = path.with_suffix(".toml.tmp")
    tmp.write_text(body, encoding="utf-8")
    tmp.replace(path)
    return path
