"""``python -m lightning_aesgd.bench seeds [options]``: the seed papers' claims, each measured and judged.

Every claim of :data:`~lightning_aesgd.bench.seeds.claims.CLAIMS` runs as a small race
(:func:`~lightning_aesgd.bench.race.benchmark.run_benchmark`, in ``<out>/<claim>/``), its entrants' medians
become :class:`~lightning_aesgd.bench.seeds.verdicts.Measured` figures, and the claim's rule gives a verdict.
The program writes ``seeds.md`` (the table "claim | paper says | we measured | verdict", then each claim's race
table) and ``seeds.json`` (every figure) in ``--out``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
import traceback
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lightning_aesgd.bench.common import comma_list, markdown_table, write_json
from lightning_aesgd.bench.race.benchmark import BenchResult, BenchSettings, run_benchmark
from lightning_aesgd.bench.race.program import TINY_EPOCHS, quiet_lightning
from lightning_aesgd.bench.race.recorder import RunRecord
from lightning_aesgd.bench.race.report import MACHINE_NOTE
from lightning_aesgd.bench.race.suites import Target, get_workload
from lightning_aesgd.bench.seeds.claims import CLAIMS, Claim, Entrant, get_claims
from lightning_aesgd.bench.seeds.verdicts import Measured, Verdict, faster_verdict, not_run

TABLE_FILE = "seeds.md"
RESULTS_FILE = "seeds.json"


@dataclass
class ClaimResult:
    """A claim's outcome: its verdict, the judged entrants' figures, and the race's own table."""

    claim: Claim
    verdict: Verdict
    measured: list[Measured] = field(default_factory=list)
    left_out: list[str] = field(default_factory=list)
    race_table: str = ""
    seconds: float = 0.0


def epochs_to_target(record: RunRecord, target: Target, epochs: int) -> float | None:
    """Epochs of data processed when a validation first met ``target``; ``None`` if none did.

    An epoch is the run's samples over its ``epochs``; a validation after global step ``s`` comes after the
    samples of steps ``0 … s−1``.

    Example:
        >>> from lightning_aesgd.bench.race.recorder import Validation
        >>> record = RunRecord(2, [1.0, 2.0, 3.0, 4.0], [50, 50, 50, 50], [Validation(3.0, 3, 1, {"val/acc": 0.9})])
        >>> epochs_to_target(record, Target("val/acc", 0.8), epochs=2)
        1.5
    """
    per_epoch = record.total_samples / epochs if epochs > 0 else 0.0
    if per_epoch <= 0:
        return None
    for validation in record.validations:
        value = validation.metrics.get(target.metric)
        if value is not None and target.reached(value):
            return sum(record.samples[: validation.step]) / per_epoch
    return None


def median_or_none(values: Sequence[float | None]) -> float | None:
    """The median, a missing value counting as infinitely late; ``None`` when most are missing.

    Example:
        >>> median_or_none([1.0, None, 2.0]), median_or_none([1.0, None, None]), median_or_none([])
        (2.0, None, None)
    """
    if not values:
        return None
    middle = statistics.median(math.inf if v is None else v for v in values)
    return middle if math.isfinite(middle) else None


def judge(claim: Claim, measured: Sequence[Measured], metric: str) -> Verdict:
    """The claim's verdict from its entrants' figures (controls are not judged)."""
    by_name = {m.name: m for m in measured}
    if claim.candidate not in by_name:
        return not_run(f"{claim.candidate} failed")
    rivals = [by_name[name] for name in claim.rivals if name in by_name]
    if not rivals:
        return not_run("no rival ran")
    verdict = faster_verdict(by_name[claim.candidate], rivals, claim.pace, claim.tolerance, metric=metric)
    controls = [m for m in measured if m.name != claim.candidate and m.name not in claim.rivals]
    if not controls:
        return verdict
    unit = " s" if claim.pace == "time" else " epochs"
    shown = [f"{m.name} {_figure(m.pace(claim.pace), unit)}, final {_figure(m.final_metric, '')}" for m in controls]
    return Verdict(verdict.status, f"{verdict.measured}; control (not judged): {'; '.join(shown)}")


def _figure(value: float | None, unit: str) -> str:
    if value is None:
        return "not reached" if unit else "–"
    return f"{value:.1f}{unit}" if unit == " s" else f"{value:.2f}{unit}" if unit else f"{value:.4f}"


def seeds_table(results: Sequence[ClaimResult]) -> str:
    """The summary: one row per claim, "claim | paper says | we measured | verdict"."""
    rows = [
        [f"{r.claim.title} ({r.claim.source})", r.claim.statement, r.verdict.measured, f"**{r.verdict.status}**"]
        for r in results
    ]
    return markdown_table(["claim", "paper says", "we measured", "verdict"], rows)


@dataclass(frozen=True)
class SeedsOptions:
    """What every claim's race shares: output folder, and overrides of the claims' own settings."""

    out: Path
    repeats: int | None = None
    epochs: int | None = None
    target: str | None = None
    tiny: bool = False


def measure_claim(claim: Claim, options: SeedsOptions) -> ClaimResult:
    """Race the claim's entrants and judge; a claim that cannot run (or fails) gets a *not run* verdict."""
    missing = claim.missing()
    if missing:
        names = ", ".join(f"configs/algorithm/{name}.yaml" for name in missing)
        return ClaimResult(claim, not_run(f"algorithm missing ({names})"))
    entrants, left_out = claim.present_entrants()
    workload = get_workload(claim.workload)
    target = Target.parse(options.target or claim.target or workload.target)
    settings = BenchSettings(
        workload=claim.workload,
        profiles=[claim.profile],
        algorithms=[entrant.name for entrant in entrants],
        epochs=options.epochs or claim.epochs or (TINY_EPOCHS if options.tiny else workload.epochs),
        repeats=options.repeats or claim.repeats,
        target=target,
        out=options.out / claim.key,
        overrides=list(claim.overrides),
        tiny=options.tiny,
        variants={entrant.name: entrant.selection(options.tiny) for entrant in entrants},
        measure_solo=False,
    )
    print(f"\n== {claim.key}: {claim.title} ==")
    started = time.perf_counter()
    try:
        bench = run_benchmark(settings)
    except Exception as error:  # one failed claim must not lose the others
        traceback.print_exc()
        return ClaimResult(claim, not_run(f"failed ({type(error).__name__}: {error})"))
    measured = _measured(bench, entrants, settings)
    result = ClaimResult(
        claim,
        judge(claim, measured, target.metric),
        measured,
        [f"{entrant.name} (configs/algorithm/{entrant.algorithm}.yaml missing)" for entrant in left_out],
        bench.table,
        time.perf_counter() - started,
    )
    print(f"{claim.key}: {result.verdict.status}; {result.verdict.measured}")
    return result


def _measured(bench: BenchResult, entrants: Sequence[Entrant], settings: BenchSettings) -> list[Measured]:
    rows = {row.algorithm: row for row in bench.rows}
    measured = []
    for entrant in entrants:
        row = rows.get(entrant.name)
        if row is None:  # every repeat failed
            continue
        paces = [
            epochs_to_target(RunRecord.load(settings.out / run.record), settings.target, settings.epochs)
            for run in bench.runs
            if run.algorithm == entrant.name and run.error is None and run.record is not None
        ]
        measured.append(Measured(entrant.name, row.time_to_target, median_or_none(paces), row.final_metric))
    return measured


def write_report(out: Path, results: Sequence[ClaimResult], settings: dict[str, Any]) -> list[Path]:
    """Write ``seeds.md`` (summary, then each claim's race) and ``seeds.json``; returns the paths."""
    sections = [seeds_table(results), "", MACHINE_NOTE]
    for result in results:
        claim = result.claim
        sections += ["", f"## {claim.key}: {claim.title}", "", f"*{claim.source}.* {claim.statement}", ""]
        sections.append(
            f"Workload `{claim.workload}`, devices `{claim.profile}`; judged: `{claim.candidate}` against "
            + ", ".join(f"`{name}`" for name in claim.rivals)
            + f" by {claim.pace} to target (final metric within {claim.tolerance:g} of the best rival)."
        )
        if result.left_out:
            sections.append(f"Left out: {', '.join(result.left_out)}.")
        sections += ["", result.race_table or result.verdict.measured]
    table_path = out / TABLE_FILE
    table_path.parent.mkdir(parents=True, exist_ok=True)
    table_path.write_text("\n".join(sections) + "\n")
    data = {
        "note": MACHINE_NOTE,
        "settings": settings,
        "claims": [
            {
                "key": r.claim.key,
                "title": r.claim.title,
                "source": r.claim.source,
                "statement": r.claim.statement,
                "candidate": r.claim.candidate,
                "rivals": list(r.claim.rivals),
                "pace": r.claim.pace,
                "verdict": asdict(r.verdict),
                "measured": [_finite(asdict(m)) for m in r.measured],
                "left_out": r.left_out,
                "seconds": r.seconds,
            }
            for r in results
        ],
    }
    return [table_path, write_json(out / RESULTS_FILE, data)]


def _finite(row: dict[str, Any]) -> dict[str, Any]:
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()}


def build_parser() -> argparse.ArgumentParser:
    """The program's options."""
    parser = argparse.ArgumentParser(
        prog="aesgd-bench seeds",
        description="Reproduce the seed papers' claims (Adaptive SGD's headline, Crossbow's statistical "
        "efficiency of SMA at small batches, ABS-SGD's speed-up), each as a small race with the paper's statement "
        "and a verdict, written as seeds.md and seeds.json.",
    )
    parser.add_argument("--claims", default=",".join(c.key for c in CLAIMS), help="comma list of claims to run")
    parser.add_argument("--out", type=Path, default=Path("bench_results") / "seeds", help="output directory")
    parser.add_argument("--repeats", type=int, help="repeats of every claim's race (default: each claim's own)")
    parser.add_argument("--quick", action="store_true", help="one repeat per claim (about half the time)")
    parser.add_argument("--epochs", type=int, help="epochs of every run (default: each workload's)")
    parser.add_argument("--target", help="target '<metric>=<value>' of every claim (default: each claim's own)")
    parser.add_argument("--tiny", action="store_true", help="a seconds-long configuration (tests)")
    parser.add_argument("--verbose", action="store_true", help="keep Lightning's and the strategy's messages")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Measure the chosen claims, print the summary table and write the files; returns the exit status."""
    parser = build_parser()
    options = parser.parse_args(argv)
    try:
        claims = get_claims(comma_list(options.claims))
    except KeyError as error:
        parser.error(str(error.args[0]))
    shared = SeedsOptions(
        out=options.out,
        repeats=1 if options.quick or options.tiny else options.repeats,
        epochs=options.epochs,
        target=options.target,
        tiny=options.tiny,
    )
    started = time.perf_counter()
    with nullcontext() if options.verbose else quiet_lightning():
        results = [measure_claim(claim, shared) for claim in claims]
    seconds = time.perf_counter() - started
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(shared).items()}
    files = write_report(options.out, results, settings | {"claims": [c.key for c in claims], "seconds": seconds})
    print(f"\n{seeds_table(results)}\n")
    print(f"{len(results)} claims in {seconds:.0f} s. Wrote {', '.join(str(p) for p in files)}")
    return 0
