"""Per-capability offsets for the fused rule (``capd calibrate --offsets``).

A number per capability that the fused rule adds to its score ``F`` (``[gates.fused.offsets]``
of a tap's ``capd.toml``; :func:`capd.tap_config.tap_config` reads them, :mod:`capd.calibrate_write`
writes them), fitted on the fit part's positives by :func:`fit_offsets`. Opt-in: held out they
lifted top1 on four of six sets but left a limit a row or two over on others
(``benchmarks/quality/README.md``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from capd.evaluation import ScoreTable
from capd.tap_config import MAX_OFFSET

OFFSET_PENALTIES = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2)  # λ tried for the offsets; each tap's is chosen by CV
OFFSET_FOLDS = 5
OFFSET_MIN_ROWS = 3  # fit rows a capability needs to get an offset (the others keep 0)


@dataclass(frozen=True)
class OffsetFit:
    """What :func:`fit_offsets` fitted: ``offsets`` (capability name -> value; what ``--write``
    stores and the daemon adds), and ``by_row`` ``[rows, capabilities]``: what each fixture row is
    scored with while the gates are fitted. A row the offsets were fitted on gets those fitted
    without its fold (else the gates would be fitted on rows the offsets had already learned, and
    the limits would hold on them only); every other row (nulls, the held-out part) gets ``offsets``."""

    offsets: dict[str, float]
    by_row: np.ndarray


def fit_offsets(table: ScoreTable, rows: np.ndarray) -> OffsetFit:
    """Per-capability offsets added to the fused score ``F``, fitted on the positive ``rows`` of
    ``table`` (scored without offsets) that expect one capability: the ``d`` that minimises the
    rows' mean cross-entropy of ``softmax(F + d)`` plus ``λ·‖d‖²``. A capability whose examples
    pull too few of its own messages (or too many of its neighbours') is moved up (or down), which
    the head and the nearest examples, fitted on a few triggers each, cannot see. Only capabilities
    with ``OFFSET_MIN_ROWS`` fit rows or more get one (a tap's fixtures need not cover every
    capability, and one without rows would only be pushed down). ``λ`` is the one of
    ``OFFSET_PENALTIES`` with the lowest cross-entropy over ``OFFSET_FOLDS`` folds of those rows.
    Rounded to 3 decimals: what ``--write`` stores is what was measured."""
    columns = len(table.names)
    none = OffsetFit({}, np.zeros((len(table.fixtures), columns), dtype=np.float32))
    single = table.expected.sum(axis=1) == 1
    chosen = np.asarray([r for r in rows if table.positive[r] and single[r] and table.routable[r]], dtype=np.int64)
    if not len(chosen):
        return none
    scores = table.scores[chosen].astype(np.float64)
    labels = table.expected[chosen].argmax(axis=1)
    free = np.bincount(labels, minlength=columns) >= OFFSET_MIN_ROWS
    if not free.any():
        return none
    folds = np.arange(len(chosen)) % OFFSET_FOLDS
    best: tuple[float, list[np.ndarray]] | None = None
    for penalty in OFFSET_PENALTIES:
        fitted = [_offsets(scores[folds != k], labels[folds != k], free, penalty) for k in range(OFFSET_FOLDS)]
        loss = sum(_cross_entropy(scores[folds == k], labels[folds == k], fitted[k]) for k in range(OFFSET_FOLDS))
        if best is None or loss < best[0]:
            best, chosen_penalty = (loss, fitted), penalty
    assert best is not None
    offsets = np.round(_offsets(scores, labels, free, chosen_penalty), 3)
    by_row = np.tile(offsets.astype(np.float32), (len(table.fixtures), 1))
    for k, fold_offsets in enumerate(best[1]):
        by_row[chosen[folds == k]] = np.round(fold_offsets, 3)
    return OffsetFit({table.names[c]: float(offsets[c]) for c in np.flatnonzero(free) if offsets[c]}, by_row)


def _cross_entropy(scores: np.ndarray, labels: np.ndarray, offsets: np.ndarray) -> float:
    shifted = scores + offsets
    top = shifted.max(axis=1)
    rows = np.arange(len(labels))
    return float(np.sum(top + np.log(np.exp(shifted - top[:, None]).sum(axis=1)) - shifted[rows, labels]))


def _offsets(scores: np.ndarray, labels: np.ndarray, free: np.ndarray, penalty: float) -> np.ndarray:
    """The offsets (0 where not ``free``) minimising the mean cross-entropy plus ``penalty·‖d‖²``."""
    from scipy.optimize import minimize  # as capd.fused: only when fitting

    n = len(labels)
    if n == 0:
        return np.zeros(scores.shape[1])
    counts = np.bincount(labels, minlength=scores.shape[1])

    def loss_and_gradient(values: np.ndarray) -> tuple[float, np.ndarray]:
        offsets = np.zeros(scores.shape[1])
        offsets[free] = values
        shifted = scores + offsets
        top = shifted.max(axis=1, keepdims=True)
        exp = np.exp(shifted - top)
        total = exp.sum(axis=1)
        loss = float(np.mean(top[:, 0] + np.log(total) - shifted[np.arange(n), labels]))
        loss += penalty * float(values @ values)
        gradient = ((exp / total[:, None]).sum(axis=0) - counts) / n
        return loss, gradient[free] + 2 * penalty * values

    found = minimize(loss_and_gradient, np.zeros(int(free.sum())), jac=True, method="L-BFGS-B")
    offsets = np.zeros(scores.shape[1])
    offsets[free] = np.clip(found.x, -MAX_OFFSET, MAX_OFFSET)
    return offsets
