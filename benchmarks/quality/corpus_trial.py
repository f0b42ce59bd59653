"""Research harness: a larger abstain corpus, or more votes for it; ``splits_trial`` with either in force.

Run: ``.venv/bin/python -m benchmarks.quality.corpus_trial [--add FILE [--add-first N]]
[--corpus-votes K] [--sets core,healthcare,snips7] [--splits 5] [--out PATH]`` (the ``splits_trial``
options apply; fused rule, untuned model). Results: benchmarks/quality/README.md, *A larger abstain
corpus, and two votes for it*.

The abstain corpus vetoes a winner when the message is nearer one of its messages than the
winner's nearest example (:class:`capd.vetoes.Vetoes`), so how much of everyday chat it covers
decides how much chat it turns away, and how many of its messages sit near real requests decides
what it costs. ``--add FILE`` adds FILE's messages (one a line, ``#`` comments skipped; the first
``N`` with ``--add-first N``) to the shipped corpus; ``benchmarks/quality/abstain_corpus_candidates.txt``
holds the candidates measured. ``--corpus-votes K`` asks the K-th nearest corpus message to be
nearer than the winner's nearest example (:data:`capd.vetoes.CORPUS_VETO_VOTES`; a tap's vetoes
ask two). Everything that reads the corpus sees the change: calibration's with/without choice
(``--corpus on|off`` is ``splits_trial``'s own option for that choice), the vetoes and the auto
gates. Compare with a plain ``splits_trial`` run on the same sets and splits. ``--nearest`` instead
prints, over taps/core's fixture positives and nulls, the median cosine of the nearest and
second-nearest corpus message, shipped and with ``--add`` (seconds).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

import capd.vetoes
from capd.vetoes import corpus_messages


@contextmanager
def corpus_in_force(added: list[str], votes: int) -> Iterator[None]:
    """Within the block, :func:`capd.vetoes.abstain_corpus` is the shipped corpus plus ``added``,
    and a corpus veto takes ``votes`` of its messages."""
    shipped, shipped_votes = capd.vetoes.ABSTAIN_CORPUS, capd.vetoes.CORPUS_VETO_VOTES
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "abstain_corpus.txt"
        path.write_text("\n".join([*corpus_messages(shipped), *added]) + "\n", encoding="utf-8")
        capd.vetoes.ABSTAIN_CORPUS, capd.vetoes.CORPUS_VETO_VOTES = path, votes
        try:
            yield
        finally:
            capd.vetoes.ABSTAIN_CORPUS, capd.vetoes.CORPUS_VETO_VOTES = shipped, shipped_votes


def nearest(added: list[str]) -> None:
    """Print the median cosine of taps/core's fixture rows to their nearest and second-nearest
    corpus message, with the shipped corpus and with ``added`` too."""
    from benchmarks.quality.run import CACHE, ROOT
    from capd.encoder import open_encoder
    from capd.fixtures import load_fixtures, tap_fixture_files
    from capd.settings import Settings

    fixtures = load_fixtures(tap_fixture_files(ROOT / "taps" / "core"))
    encoder = open_encoder(Settings(data_dir=CACHE, taps=()))
    rows = encoder.embed([f.message for f in fixtures])
    positive = np.array([f.positive for f in fixtures])
    shipped = list(corpus_messages(capd.vetoes.ABSTAIN_CORPUS))
    for corpus in (shipped, shipped + added):
        ranked = np.sort(rows @ encoder.embed(corpus).T, axis=1)
        for kind, mask in (("positives", positive), ("nulls", ~positive)):
            print(f"corpus of {len(corpus)}, {kind:9s}: median cosine of the nearest "
                  f"{np.median(ranked[mask, -1]):.3f}, of the second-nearest {np.median(ranked[mask, -2]):.3f}")


def main(argv: list[str]) -> dict[str, Any]:
    from benchmarks.quality import splits_trial

    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--add", type=Path, help="add this file's messages to the shipped corpus")
    parser.add_argument("--add-first", type=int, help="add only the file's first N messages")
    parser.add_argument("--nearest", action="store_true", help="print the corpus's distances to taps/core's rows")
    parser.add_argument("--corpus-votes", type=int, default=capd.vetoes.CORPUS_VETO_VOTES,
                        help="corpus messages that must be nearer than the winner's nearest example")
    args, rest = parser.parse_known_args(argv)  # the rest are splits_trial's options
    added = list(corpus_messages(args.add)[:args.add_first]) if args.add else []
    if args.nearest:
        nearest(added)
        return {}
    if "--sets" not in rest:
        rest += ["--sets", "core,healthcare,snips7"]
    if "--out" not in rest:
        rest += ["--out", f"benchmarks/results/corpus_trial_add{len(added)}_votes{args.corpus_votes}.json"]
    with corpus_in_force(added, args.corpus_votes):
        return splits_trial.main(rest)


if __name__ == "__main__":
    main(sys.argv[1:])
