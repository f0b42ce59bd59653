"""``capd lint --embeddings``: near-duplicate triggers across capabilities.

Two triggers of different capabilities whose vectors are nearly the same pull a message
towards both capabilities at once; the margin gate then abstains. Each such pair is a
warning (code ``near-duplicate``) on the later capability's ``config.toml``, at the line of
its trigger, naming both capabilities and both triggers.

The bound is the model's ``[lint] near_duplicate`` (see ``models/*.toml``): 0.90 for the
bundled MiniLM, chosen on real data. Across the shared eval taps (1,351 triggers, 342,219
cross-capability pairs) the 99.9th percentile cross-capability cosine is 0.56 and the
largest 0.88, and the pairs between 0.80 and 0.88 are distinct intents that merely share
words ("tell me how to request vacation" / "tell me about my vacation request": 0.88).
Rewordings of one request sit above 0.90 ("open a pull request" / "create a pull request":
0.91, "what's my credit score" / "what is my credit score": 0.99).
Exact duplicates are ``capd lint``'s own ``shared-trigger`` error
and are not repeated here.

It always uses the untuned model, also with ``tune = true``, and says so in each warning: a
tuned model is trained on these very triggers to pull each capability's apart from the
others', so it would hide the near-duplicates this check exists to find (unseen messages
still land between them), and the bound above was measured on the untuned model's scale.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from capd.catalog import Capability, Catalog, Problem
from capd.embedder import CachedEmbedder
from capd.encoder import Vectors, open_encoder
from capd.lint import _normal, _trigger_line
from capd.models import manifest_for
from capd.settings import Settings, own_data_dir
from capd.vectorcache import VectorCache

BLOCK = 2048  # rows per block of the pairwise product (bounds memory at BLOCK x n floats)


def near_duplicates(catalog: Catalog, settings: Settings) -> list[Problem]:
    """Warnings for trigger pairs in different capabilities at or above the model's bound."""
    items = [(capability, trigger) for capability in catalog for trigger in capability.triggers]
    if not items:
        return []
    manifest = manifest_for(settings)
    bound = manifest.near_duplicate
    model = f"{manifest.name}, untuned" if settings.tune else manifest.name
    own_data_dir(settings.data_dir)
    cache = VectorCache.open(settings.data_dir)
    try:
        embedder = CachedEmbedder(open_encoder(settings), cache)
        vectors, _, _ = embedder.embed([t for _, t in items])
    finally:
        cache.close()
    problems = []
    for i, j, cosine in _pairs(vectors, [c.name for c, _ in items], bound):
        (first, first_trigger), (second, second_trigger) = items[i], items[j]
        if _normal(first_trigger) == _normal(second_trigger):
            continue  # an exact duplicate: reported by the static lint as shared-trigger
        problems.append(_problem(first, first_trigger, second, second_trigger, cosine, model))
    return problems


def _pairs(vectors: Vectors, owners: list[str], bound: float) -> Iterator[tuple[int, int, float]]:
    """``(i, j, cosine)`` with i < j, different owners and cosine >= bound, in order."""
    owner_ids = np.unique(np.array(owners), return_inverse=True)[1]
    for start in range(0, len(vectors), BLOCK):
        sims = vectors[start:start + BLOCK] @ vectors.T
        rows, cols = np.nonzero(sims >= bound - 1e-6)
        rows_abs = rows + start
        keep = (cols > rows_abs) & (owner_ids[rows_abs] != owner_ids[cols])
        for i, j in zip(rows_abs[keep].tolist(), cols[keep].tolist(), strict=True):
            yield i, j, float(sims[i - start, j])


def _problem(first: Capability, first_trigger: str, second: Capability, second_trigger: str,
             cosine: float, model: str) -> Problem:
    other = f"{first.path / 'config.toml'}"
    line = _trigger_line(first, first_trigger)
    where = f"{other}: line {line}" if line is not None else other
    return Problem(
        "warning", str(second.path / "config.toml"),
        f"trigger {second_trigger!r} of {second.name!r} is a near-duplicate (cosine {cosine:.3f}, {model}) of trigger "
        f"{first_trigger!r} of {first.name!r} ({where}); messages like it will sit between the two "
        "capabilities and the margin gate will abstain: reword or remove one",
        _trigger_line(second, second_trigger), second.name, "near-duplicate")
