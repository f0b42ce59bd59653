"""Rendering of the routing-quality report (``quality.md``) from the measurements of :mod:`.run`."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from benchmarks.quality.run import CORE_CAL, FEEDBACK_SETS, GOAL, LIMITS, METRICS, RESEARCH, ROOT, RULES, TUNED
from capd.calibrate import FOLDS, corpus_rule
from capd.calibrate_examples import EXAMPLES_MIN_GAIN


def fmt(value: float | None) -> str:
    return "—" if value is None else f"{value:.3f}"


def delta(after: float | None, before: float | None) -> str:
    return "—" if after is None or before is None else f"{after - before:+.3f}"


def meets(name: str, value: float | None) -> bool | None:
    if value is None:
        return None
    return value >= GOAL[name] if name in ("top1", "fired_right") else value <= GOAL[name]


def gates_text(gates: dict[str, Any], rule: str) -> str:
    text = f"{gates['threshold']:g} / {gates['margin']:g}"
    if not rule.startswith("fused"):
        text = f"{text}, k={int(gates['top_k'])}"
    elif gates.get("coverage"):
        text = f"{text}, coverage {gates['coverage']:g}"
    return f"{text} + abstain corpus" if gates.get("abstain_corpus") else text


def row(label: str, gates: str, split_label: str, values: dict[str, Any]) -> str:
    cells = " | ".join(fmt(values[m]) for m in METRICS)
    return f"| {label} | {gates} | {split_label} | {cells} | {values['positives']}/{values['nulls']} |"


def held_sizes(values: dict[str, Any]) -> str:
    nulls = values["nulls"]
    return f"{values['positives']} / {nulls}" + (f" (1 null = {1 / nulls:.3f})" if nulls else " (no nulls)")


def summary_lines(result: dict[str, Any], after_rule: str = "fused", after: str = "calibrated") -> list[str]:
    """Before (anchor, calibrated) → after (``after_rule``'s ``after`` calibration), held out, per set."""
    lines = ["| set | held-out positives / nulls | " + " | ".join(f"{m} before → after" for m in METRICS)
             + " | goal met (after) |", "|---|---|" + "---|" * len(METRICS) + "---|"]
    for name, data in result["sets"].items():
        before = data["rules"]["anchor"].get("calibrated", {}).get("held_out")
        after_rows = data["rules"].get(after_rule, {}).get(after, {}).get("held_out")
        if before is None or after_rows is None:
            lines.append(f"| {name} | — | no gates within the limits on the fit part |" + " |" * len(METRICS))
            continue
        cells, verdicts = [], []
        for m in METRICS:
            verdict = meets(m, after_rows[m])
            verdicts.append(verdict)
            mark = "" if verdict is None else " ✓" if verdict else " ✗"
            cells.append(f"{fmt(before[m])} → {fmt(after_rows[m])}{mark}")
        met = "no" if False in verdicts else "yes" if None not in verdicts else "yes (no nulls: null_fpr untested)"
        lines.append(f"| {name} | {held_sizes(after_rows)} | " + " | ".join(cells) + f" | {met} |")
    return lines


def split_note(data: dict[str, Any]) -> str:
    """How a set's rows are split, when it is not by hash (:attr:`~benchmarks.quality.run.EvalSet.held_files`)."""
    if "held_files" not in data:
        return ""

    def names(paths: list[str]) -> str:
        return ", ".join(f"`{Path(p).parent.name}/{Path(p).name}`" for p in paths)
    return (f" Split by file: the fit part is the part of {names(data['fixtures'])} that `capd calibrate` fits "
            f"on when given those files (its own 30% held out is left out), and the held-out part is every row "
            f"of {names(data['held_files'])}, as the tap's author calibrates and then runs `capd test`.")


def set_lines(name: str, data: dict[str, Any]) -> list[str]:
    lines = [f"### {name}", "", f"{data['rows']} rows; tap `{data['tap']}`.{split_note(data)} Gates: threshold / "
             "margin (anchor: cosine, k = top-k; fused: level K − μ_in / log-odds gap, and the coverage gate when "
             "calibration turns it on).", "",
             "| row | gates | part | top1 | fired_right | fired_wrong | null_fpr | positives/nulls |",
             "|---|---|---|---|---|---|---|---|"]
    for rule in (r for r in (*RULES, *TUNED) if r in data["rules"]):
        r = data["rules"][rule]
        label = "production" if rule.startswith("anchor") else "manifest default"
        lines.append(row(f"{rule}, {label} gates", gates_text(r["default"]["gates"], rule), "held-out",
                         r["default"]["held_out"]))
        if "auto" in r:
            g = gates_text(r["auto"]["gates"], rule)
            lines.append(row(f"{rule}, auto gates (no fixtures)", g, "held-out", r["auto"]["held_out"]))
            lines.append(row(f"{rule}, auto gates (no fixtures)", g, "fit", r["auto"]["fit"]))
        if "tap_gates" in r:  # the tap's capd.toml, fitted on other messages (taps/core/calibration)
            g = gates_text(r["tap_gates"]["gates"], rule)
            lines.append(row(f"**{rule}, the tap's capd.toml**", g, "**held-out**", r["tap_gates"]["held_out"]))
            if "held_files" not in data:  # split by file, the fit part is what the tap's gates were fitted on
                lines.append(row(f"{rule}, the tap's capd.toml", g, "all rows (none seen)", r["tap_gates"]["all"]))
        if "calibrated" in r:
            g = gates_text(r["calibrated"]["gates"], rule)
            lines.append(row(f"**{rule}, calibrated on fit part**", g, "**held-out**", r["calibrated"]["held_out"]))
            lines.append(row(f"{rule}, calibrated on fit part", g, "fit (tuned on)", r["calibrated"]["fit"]))
        else:
            lines.append(f"| {rule}, calibrated | no gates within the limits on the fit part | | | | | | |")
        ablations = (("calibrated_no_coverage", "the coverage gate"), ("calibrated_no_vetoes", "the tap's vetoes"))
        for key, part in ablations:
            if key in r:
                g = gates_text(r[key]["gates"], rule)
                lines.append(row(f"{rule}, calibrated without {part}", g, "held-out", r[key]["held_out"]))
                lines.append(row(f"{rule}, calibrated without {part}", g, "fit (tuned on)", r[key]["fit"]))
        if "all_rows" in r:
            lines.append(row(f"{rule}, best within limits on all rows", gates_text(r["all_rows"]["gates"], rule),
                             "all rows (tuned on: ceiling)", r["all_rows"]["all"]))
    tried = [f"{rule} {fmt(r['abstain_corpus']['without'])} → {fmt(r['abstain_corpus']['with'])}"
             for rule, r in data["rules"].items() if (r.get("abstain_corpus") or {}).get("with") is not None]
    if tried:
        lines += ["", "Abstain corpus, calibration's choice (best fit-part fired_right within the limits without → "
                  f"with it; {corpus_rule()}): " + "; ".join(tried) + "."]
    return [*lines, ""]


def manifest_lines(manifest: dict[str, Any]) -> list[str]:
    gates = manifest["gates"]
    lines = [f"Default gates from the model manifest `{os.path.relpath(manifest['path'], ROOT)}`: anchor "
             f"{gates_text(gates['anchor'], 'anchor')} (the anchor's production gates; what a tap without "
             f"`capd.toml` gets under `capd` and `anchor`), fused {gates_text(gates['fused'], 'fused')} (what it "
             "gets under `fused` with `auto_gates = false`, or when no auto-gate point is feasible)."]
    if manifest["fused_note"]:
        lines.append(f"The manifest says of the fused defaults: *{manifest['fused_note']}*")
    return [*lines, ""]


def feedback_lines(result: dict[str, Any]) -> list[str]:
    runs = {n: d["feedback"] for n, d in result["sets"].items() if "feedback" in d}
    runs.update({f"{n} (tuned model)": d["feedback_tuned"] for n, d in result["sets"].items()
                 if "error" not in d.get("feedback_tuned", {"error": None})})
    if not result["learning_available"]:
        return ["Not available: this build of capd has no `Service.apply_learned` (learning from corrections).", ""]
    if not runs:
        return [f"Not run: none of {', '.join(FEEDBACK_SETS)} was in this run.", ""]
    lines = ["For each fit-part message: route it in its own session with the fused rule at the calibrated gates; "
             "if a positive did not activate an expected capability, enable the expected one by hand "
             "(`registry.activate(..., \"manual\")`: a learned trigger); if a null activated a capability, disable "
             "it (`registry.deactivate`: a learned abstain, which vetoes that capability for messages nearer the "
             "refused one than its examples); then `apply_learned()` and score the **held-out** part again. "
             "The held-out messages are never corrected. *triggers only* leaves the abstains out. (b) is a "
             "separate run that corrects alternate fit rows only (counts in brackets) and then recalibrates the "
             "gates on the other, uncorrected fit rows (the limits of `capd calibrate`), so its gates are not "
             "fitted on memorised rows. Rows marked *(tuned model)* do the same with `tune = true` at the gates "
             "calibrated for fused + tuned.",
             "",
             "| set | routed / enabled / disabled / learned | held-out | gates | top1 | fired_right | fired_wrong | "
             "null_fpr |",
             "|---|---|---|---|---|---|---|---|"]
    for name, f in runs.items():
        counts = f"{f['routed']} / {f['corrected']} / {f.get('refused', 0)} / {f['learned']} ({f['seconds']} s)"
        if "refit_traffic" in f:
            half = f["refit_traffic"]
            counts += f" [(b): {half['routed']} / {half['corrected']} / {half['refused']} / {half['learned']}]"
        variants = [("before", f["gates"], f["before"])]
        if "after_triggers_only" in f:
            variants.append(("after, triggers only, same gates", f["gates"], f["after_triggers_only"]))
        variants.append(("after, same gates (a)", f["gates"], f["after_same_gates"]))
        if "after_refit" in f:
            variants.append(("after (b), gates recalibrated on uncorrected rows", f["refit_gates"], f["after_refit"]))
        for label, gates, values in variants:
            cells = " | ".join(fmt(values[m]) for m in METRICS)
            lines.append(f"| {name} | {counts} | {label} | {gates_text(gates, 'fused')} | {cells} |")
            counts = ""
        for label, key in (("gain (a) − before", "after_same_gates"), ("gain (b) − before", "after_refit")):
            if key in f:
                deltas = " | ".join(delta(f[key][m], f["before"][m]) for m in METRICS)
                lines.append(f"| {name} | | {label} | | {deltas} |")
    return [*lines, ""]


def timing_lines(result: dict[str, Any]) -> list[str]:
    lines = ["One message at a time, p50 over up to 200 of the set's messages. *score* = scoring an "
             "already-embedded message (anchor: `index.named_scores`; fused: `router.fused_scores` with its "
             "second stage); *encode* = the bare ONNX encoder (vector only) and `service.encoder` (micro-batcher, "
             "vector and token vectors, as a fused route asks) on one message. *with --examples*: the same "
             "scoring with the fit part's positives as more examples (`capd calibrate --examples`).", "",
             "| set | capabilities | fused examples | encode ms | service.encoder ms | anchor score ms | "
             "fused score ms | fused route / bare encode | with --examples: examples, score ms, route / encode |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, data in result["sets"].items():
        t, rules = data["timing"], data["rules"]
        fused, encode, service_encode = t["fused"]["score_ms"], t["fused"]["encode_ms"], t["fused"]["service_encode_ms"]
        with_examples = "—"
        if (score := t["fused"].get("score_examples_ms")) is not None:
            added = (rules["fused"].get("calibrated_examples") or {}).get("examples")
            with_examples = (f"{rules['fused']['examples']} + {added if added is not None else '?'}, {score:.3f}, "
                             f"{(service_encode + score) / encode:.2f}×")
        # a fused route encodes through the service (token vectors too, a thread hand-off), then scores
        lines.append(f"| {name} | {rules['fused']['capabilities']} | {rules['fused']['examples']} | {encode:.2f} | "
                     f"{service_encode:.2f} | {t['anchor']['score_ms']:.3f} | {fused:.3f} | "
                     f"{(service_encode + fused) / encode:.2f}× | {with_examples} |")
    return [*lines, ""]


def research_lines(out: Path) -> list[str]:
    """The ablation table and the list of what failed, quoted verbatim from the research notes."""
    link = os.path.relpath(RESEARCH, out)
    if not RESEARCH.is_file():
        return [f"(The research notes `{link}` are not in this checkout.)", ""]
    text = RESEARCH.read_text(encoding="utf-8").splitlines()

    def section(heading: str) -> list[str]:
        start = next((i for i, line in enumerate(text) if line.startswith(heading)), None)
        if start is None:
            return []
        body: list[str] = []
        for line in text[start + 1:]:
            if line.startswith("#") or (body and not line.strip()):
                break
            if line.strip():
                body.append(line)
        return body

    return [f"**Research figures, quoted from [`research_results.md`]({link}); not measured by this script.** "
            "They were produced while designing the fused rule (held-out = the same split; gates fitted on the fit "
            "part), including variants that capd does not ship, with research code rather than capd itself — where a "
            "research row and a measured row above disagree (e.g. anchor, calibrated), the measured row is current.",
            "",
            "Ablation (held-out fired_right / fired_wrong / null_fpr; top1):", "",
            *section("# Ablation / ideas"), "", "What failed (from the same file):", "",
            *section("# What failed"), ""]


def tuned_lines(result: dict[str, Any]) -> list[str]:
    """The tuned model: before (anchor, untuned) → after (fused, tuned), and what tuning cost."""
    tuned = {n: d for n, d in result["sets"].items() if any(r in d["rules"] for r in TUNED)}
    if not tuned:
        return ["Not run (`--no-tune`, or no set could be tuned).", ""]
    lines = ["`tune = true` (`capd/tuning.py`): a copy of the model fine-tuned on each tap's own examples "
             "(triggers, description, name; never fixture rows), cached by the tap's content hash. Gates "
             "calibrated on the fit part with its nulls as vetoes, without its positives as examples on either "
             "side (`--no-examples`: the tuned model trains on triggers, not examples); held-out. Before = anchor "
             "with the untuned model.", "",
             *summary_lines({"sets": tuned}, "fused+tuned"), "",
             "Held-out fired_right / top1 per rule, untuned → tuned:", "",
             "| set | anchor fired_right | fused fired_right | anchor top1 | fused top1 | tuning (steps, train s) |",
             "|---|---|---|---|---|---|"]
    for name, data in tuned.items():
        rules = data["rules"]

        def pair(rule: str, metric: str, rules: dict[str, Any] = rules) -> str:
            before = rules.get(rule, {}).get("calibrated", {}).get("held_out", {}).get(metric)
            after = rules.get(f"{rule}+tuned", {}).get("calibrated", {}).get("held_out", {}).get(metric)
            return f"{fmt(before)} → {fmt(after)}"

        trained = data.get("tuning", {}).get("trained", {})
        cost = f"{trained.get('steps', '—')}, {trained.get('seconds', '—')}"
        lines.append(f"| {name} | {pair('anchor', 'fired_right')} | {pair('fused', 'fired_right')} | "
                     f"{pair('anchor', 'top1')} | {pair('fused', 'top1')} | {cost} |")
    return [*lines, ""]


def rates_cell(values: dict[str, Any] | None) -> str:
    """fired_right / fired_wrong / null_fpr (— when not measured)."""
    if values is None:
        return "—"
    return " / ".join(fmt(values[m]) for m in ("fired_right", "fired_wrong", "null_fpr"))


def no_fixture_lines(result: dict[str, Any]) -> list[str]:
    """What a tap gets before anyone calibrates it: the anchor's production gates, the fused
    rule's manifest default and its auto gates (``capd/autogates.py``), held out."""
    lines = ["What a tap without `capd.toml` gets, held-out fired_right / fired_wrong / null_fpr. Auto gates are "
             "fitted on the tap's own examples (out of fold) and the shipped abstain corpus; no fixture row is "
             "seen, so the fit part is not tuned on either (its figures are in *Per set*).", "",
             "| set | anchor, production gates | fused, manifest default gates | **fused, auto gates** | "
             "fused+tuned, manifest default gates | fused+tuned, auto gates |", "|---|---|---|---|---|---|"]

    for name, data in result["sets"].items():
        rules = data["rules"]
        anchor, fused_rule = rules.get("anchor", {}), rules.get("fused", {})
        tuned = rules.get("fused+tuned", {})
        lines.append(f"| {name} | {rates_cell(anchor.get('default', {}).get('held_out'))} | "
                     f"{rates_cell(fused_rule.get('default', {}).get('held_out'))} | "
                     f"**{rates_cell(fused_rule.get('auto', {}).get('held_out'))}** | "
                     f"{rates_cell(tuned.get('default', {}).get('held_out'))} | "
                     f"{rates_cell(tuned.get('auto', {}).get('held_out'))} |")
    return [*lines, ""]


def without_with(result: dict[str, Any], without: str,
                 rules: Sequence[str]) -> Iterator[tuple[str, str, dict[str, Any], dict[str, Any], dict[str, Any]]]:
    """(set, rule, its results, calibrated without a part, calibrated with it) for every set and rule
    that has both: one part's contribution."""
    for name, data in result["sets"].items():
        for rule in rules:
            r = data["rules"].get(rule, {})
            if "calibrated" in r and without in r:
                yield name, rule, r, r[without], r["calibrated"]


def coverage_lines(result: dict[str, Any]) -> list[str]:
    """The coverage gate's contribution: fused calibrated without it → with it (capd calibrate's choice)."""
    lines = ["`capd calibrate` for the fused rule sweeps a third gate, coverage (`capd/fused.py`: the mean, over "
             "the message's token vectors, of each one's best cosine to any token of the winner's examples). "
             "Without → with it, same calibration otherwise; held-out fired_right / fired_wrong / null_fpr, and "
             "fit fired_right (tuned on).", "",
             "| set | rule | held-out without | held-out with | coverage chosen | fit fired_right without → with |",
             "|---|---|---|---|---|---|"]
    for name, rule, _, before, after in without_with(result, "calibrated_no_coverage", ("fused", "fused+tuned")):
        lines.append(f"| {name} | {rule} | {rates_cell(before['held_out'])} | {rates_cell(after['held_out'])} | "
                     f"{after['gates'].get('coverage', 0):g} | {fmt(before['fit']['fired_right'])} → "
                     f"{fmt(after['fit']['fired_right'])} |")
    return [*lines, ""]


def offset_lines(result: dict[str, Any]) -> list[str]:
    """``capd calibrate --offsets``: the summary with them, and calibrated without → with them."""
    lines = ["`capd calibrate --offsets` also fits a number per capability that the fused rule adds to its score "
             "(`[gates.fused.offsets]`; `capd/offsets.py`, `fit_offsets`): the offsets that minimise the fit "
             "positives' cross-entropy, L2-penalised with the penalty chosen by 5-fold cross-validation, and each "
             "fit row scored with offsets fitted without its fold while the gates are fitted. Opt-in. Before = "
             "anchor, calibrated; after = fused, calibrated with the offsets (and the vetoes), held-out:", "",
             *summary_lines(result, "fused", "calibrated_offsets"), "",
             "Without → with the offsets, same calibration otherwise; held-out top1, held-out fired_right / "
             "fired_wrong / null_fpr, and fit fired_right (without: tuned on; with: out of fold).", "",
             "| set | rule | offsets | held-out top1 | held-out without | held-out with | fit fired_right |",
             "|---|---|---|---|---|---|---|"]
    for name, data in result["sets"].items():
        for rule in ("fused", "fused+tuned"):
            r = data["rules"].get(rule, {})
            if "calibrated" in r and "calibrated_offsets" in r:
                before, after = r["calibrated"], r["calibrated_offsets"]
                lines.append(_compared(f"{name} | {rule} | {after['offsets']}", before, after))
    return [*lines, ""]


def examples_lines(result: dict[str, Any]) -> list[str]:
    """The fit positives as examples: the summary with them everywhere (``--examples``), and
    calibrated without → with them, with plain ``capd calibrate``'s choice."""
    lines = ["`capd calibrate` can route with the fit part's rows that expect one capability as more of "
             "its triggers (`--write` appends them to `<tap>/examples.jsonl`). The gates are then fitted out of "
             f"fold: the fit part is cut into {FOLDS} folds by a hash of the message, and each fit row is scored by a "
             "router whose examples are the other folds' rows (the fit nulls are vetoes, as without them); the "
             "held-out part is scored by a router with them all, as the tap routes after `--write`. It measures "
             f"both and keeps them where they add {EXAMPLES_MIN_GAIN} or more to the fit fired_right (`--examples` / "
             "`--no-examples` force it). Before = anchor, calibrated; after = fused, calibrated with the examples "
             "on every set (`--examples`; and the vetoes), held-out:",
             "", *summary_lines(result, "fused", "calibrated_examples"), "",
             "Without → with the examples, same calibration otherwise; held-out top1, held-out fired_right / "
             "fired_wrong / null_fpr, and fit fired_right (without: tuned on; with: out of fold), which "
             "`capd calibrate` chooses by.", "",
             "| set | examples | kept by `capd calibrate` | held-out top1 | held-out without | held-out with "
             "| fit fired_right |", "|---|---|---|---|---|---|---|"]
    for name, data in result["sets"].items():
        r = data["rules"].get("fused", {})
        if "calibrated" in r and r.get("calibrated_examples"):
            before, after = r["calibrated"], r["calibrated_examples"]
            kept = "yes" if (r.get("calibrated_default") or {}).get("examples_added") else "no"
            lines.append(_compared(f"{name} | {after['examples']} | {kept}", before, after))
    return [*lines, ""]


def _compared(cells: str, before: dict[str, Any], after: dict[str, Any]) -> str:
    """A without → with table row: ``cells`` first, then held-out top1, the held-out rates of each,
    and fit fired_right."""
    return (f"| {cells} | {fmt(before['held_out']['top1'])} → {fmt(after['held_out']['top1'])} | "
            f"{rates_cell(before['held_out'])} | {rates_cell(after['held_out'])} | "
            f"{fmt(before['fit']['fired_right'])} → {fmt(after['fit']['fired_right'])} |")


def veto_lines(result: dict[str, Any]) -> list[str]:
    """The tap's vetoes' contribution: calibrated without → with the fit part's null rows as vetoes."""
    lines = ["`capd calibrate` fits the gates with the fit part's null rows as the tap's vetoes (`--write` stores "
             "them in `<tap>/vetoes.jsonl`): a winner is turned away when two of them are nearer the message than "
             "the winner's nearest example, and no row is vetoed by its own copy. Without → with them, same "
             "calibration otherwise; held-out fired_right / fired_wrong / null_fpr, and fit fired_right (tuned on).",
             "", "| set | rule | vetoes | held-out without | held-out with | fit fired_right without → with |",
             "|---|---|---|---|---|---|"]
    for name, rule, r, before, after in without_with(result, "calibrated_no_vetoes", (*RULES, *TUNED)):
        lines.append(f"| {name} | {rule} | {r['vetoes']} | {rates_cell(before['held_out'])} | "
                     f"{rates_cell(after['held_out'])} | {fmt(before['fit']['fired_right'])} → "
                     f"{fmt(after['fit']['fired_right'])} |")
    return [*lines, ""]


def render(result: dict[str, Any], out: Path) -> str:
    lines = [
        "# Routing quality", "",
        f"Generated by `{result['command']}` (`make quality`, also part of `make bench`) on "
        f"{result['generated']}, {result['machine']}, in {result['seconds']} s (load {result['load_before']} → "
        f"{result['load_after']}). Model `{result['model']}`. Every number below except the quoted research "
        "section is computed by this run.", "",
        "Fit / held-out split: the one `capd calibrate` uses (`int(sha256(message)[:8], 16) % 1000 < 300` is "
        f"held out). Gates are fitted on the fit part with the limits null_fpr ≤ {LIMITS['max_null_fpr']} and "
        f"fired_wrong ≤ {LIMITS['max_wrong']}. **Headline = held-out.** Rows marked *tuned on* are measured on the "
        "rows the gates were chosen on. Calibration also decides, per set, whether to veto with the shipped "
        "abstain corpus (`+ abstain corpus` on the gates). The `capd` rule scores exactly like `anchor` (it "
        "differs in session semantics, learned corrections and vetoes), so it is not shown separately.",
        *(["", f"`{CORE_CAL}` is taps/core split by file instead: calibrated on `taps/core/calibration` (the fit "
            "part `capd calibrate` takes of it) and held out on every row of `taps/core/fixtures`, which no "
            "calibration saw; its held-out part is three times core's. Its tuned model is core's (the same tap)."]
          if CORE_CAL in result["sets"] else []), "",
        *(f"- {note}" for note in result["skipped"]), *([""] if result["skipped"] else []),
        "## Summary: before (anchor, calibrated) → after (fused, `capd calibrate`), held-out", "",
        f"Goal per set: top1 ≥ {GOAL['top1']}, fired_right ≥ {GOAL['fired_right']} with null_fpr ≤ "
        f"{GOAL['null_fpr']} and fired_wrong ≤ {GOAL['fired_wrong']}; ✓/✗ mark the *after* value. One held-out "
        "null is 1/n of null_fpr, so small sets move in large steps. *After* is what plain `capd calibrate` "
        "fits: with the fit part's null rows as vetoes, and with its positives as examples where that adds "
        f"{EXAMPLES_MIN_GAIN} or more to the fit fired_right out of fold (the next sections show each part's "
        "contribution).", "",
        *summary_lines(result, "fused", "calibrated_default"), "",
        "## The tap's vetoes: calibrated without → with the fit part's null rows", "", *veto_lines(result),
        "## The fit part's positives as examples (`capd calibrate` keeps them where they measure better)", "",
        *examples_lines(result),
        "## Per-capability offsets (`capd calibrate --offsets`)", "", *offset_lines(result),
        "## The coverage gate: fused calibrated without → with it", "", *coverage_lines(result),
        "## Tuned model: before (anchor, calibrated) → after (fused + tuned, calibrated), held-out", "",
        *tuned_lines(result),
        "## Without fixtures: default gates and auto gates, held-out", "", *no_fixture_lines(result),
        "## Per set", "", *manifest_lines(result["manifest"]),
        *(line for name, data in result["sets"].items() for line in set_lines(name, data)),
        "## Learning from corrections (simulated feedback loop)", "", *feedback_lines(result),
        "## Cost of the fused rule", "", *timing_lines(result),
        "## What we tried", "", *research_lines(out),
    ]
    return "\n".join(lines)
