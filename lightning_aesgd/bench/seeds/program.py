"""``python -m lightning_aesgd.bench seeds [options]``: the seed papers' claims, each measured and judged.

Every claim of :data:`~lightning_aesgd.bench.seeds.claims.CLAIMS` runs as a small race
(:func:`~lightning_aesgd.bench.race.benchmark.run_benchmark`, in ``<out>/<claim>/``), every repeat of its
entrants becomes :class:`~lightning_aesgd.bench.seeds.verdicts.Measured` figures, and
:func:`~lightning_aesgd.bench.seeds.verdicts.judge` gives the verdict. The program writes ``seeds.md`` (the table
"claim | paper says | rival | spread | we measured | verdict", then each claim's race table) and ``seeds.json``
(every figure) in ``--out``. It exits with status 1 when a claim failed (its race raised, or every repeat of a
judged entrant crashed), after writing the others.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from lightning_aesgd.bench.common import comma_list, markdown_table, write_json
from lightning_aesgd.bench.race.benchmark import BenchResult, BenchSettings, run_benchmark
from lightning_aesgd.bench.race.program import TINY_EPOCHS, quiet_lightning
from lightning_aesgd.bench.race.recorder import RunRecord
from lightning_aesgd.bench.race.report import MACHINE_NOTE
from lightning_aesgd.bench.race.suites import Target, get_workload
from lightning_aesgd.bench.seeds.claims import CLAIMS, Claim, Entrant, get_claims
from lightning_aesgd.bench.seeds.verdicts import (
    MIN_REPEATS,
    AllRepeatsCrashedError,
    Measured,
    Verdict,
    failed,
    not_implemented,
    not_run,
    range_text,
)
from lightning_aesgd.bench.seeds.verdicts import judge as judge_entrants
from lightning_aesgd.trainer_io import SUMMARY_FILE

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


def judge(claim: Claim, measured: Sequence[Measured], metric: str) -> Verdict:
    """The claim's verdict from its entrants' figures; controls are shown, not judged.

    The judged rivals are the claim's rivals that raced (an optional rival whose config is missing is left out,
    with a note in the report). Every raced entrant has a :class:`Measured`, crashed repeats counted in it.

    Raises:
        AllRepeatsCrashedError: every repeat of the candidate or of a judged rival crashed.
    """
    by_name = {m.name: m for m in measured}
    if claim.candidate not in by_name:
        raise AllRepeatsCrashedError([claim.candidate])
    rivals = [by_name[name] for name in claim.rivals if name in by_name]
    if not rivals:
        return failed("no rival raced")
    candidate = by_name[claim.candidate]
    verdict = judge_entrants(candidate, rivals, claim.tolerance, metric=metric)
    notes = []
    if claim.show_epochs:
        epochs = [f"{m.name} {_figure(m.epochs_to_target, ' epochs')}" for m in (candidate, *rivals)]
        notes.append(f"median epochs to target (not judged): {', '.join(epochs)}")
    controls = [m for m in measured if m.name != claim.candidate and m.name not in claim.rivals]
    if controls:
        shown = [
            f"{range_text(m)}, median {_figure(m.time_to_target, ' s')}, final {_figure(m.final_metric, '')}"
            for m in controls
        ]
        notes.append(f"control (not judged): {'; '.join(shown)}")
    if not notes:
        return verdict
    return Verdict(verdict.status, "; ".join([verdict.measured, *notes]), verdict.rival, verdict.spread)


def _figure(value: float | None, unit: str) -> str:
    if value is None:
        return "not reached" if unit else "–"
    return f"{value:.1f}{unit}" if unit == " s" else f"{value:.2f}{unit}" if unit else f"{value:.4f}"


def seeds_table(results: Sequence[ClaimResult]) -> str:
    """The summary: one row per claim, "claim | paper says | rival | spread | we measured | verdict"."""
    rows = [
        [
            f"{r.claim.title} ({r.claim.source})",
            r.claim.statement,
            r.verdict.rival or "–",
            r.verdict.spread or "–",
            r.verdict.measured,
            f"**{r.verdict.status}**",
        ]
        for r in results
    ]
    return markdown_table(["claim", "paper says", "rival", "spread", "we measured", "verdict"], rows)


@dataclass(frozen=True)
class SeedsOptions:
    """What every claim's race shares: output folder, and overrides of the claims' own settings."""

    out: Path
    repeats: int | None = None
    epochs: int | None = None
    target: str | None = None
    tiny: bool = False


def measure_claim(claim: Claim, options: SeedsOptions) -> ClaimResult:
    """Race the claim's entrants and judge.

    A claim whose algorithm config is missing is *not implemented*, and one that needs a GPU on a machine without
    one *not run* (neither is raced); one whose race raises, or whose candidate or judged rival crashed in every
    repeat, has *failed*, naming why.
    """
    missing = claim.missing()
    if missing:
        names = ", ".join(f"configs/algorithm/{name}.yaml" for name in missing)
        return ClaimResult(claim, not_implemented(f"{claim.capability or 'algorithm'} ({names} missing)"))
    if claim.needs_gpu and not torch.cuda.is_available():
        command = f"python -m lightning_aesgd.bench seeds --claims {claim.key}"
        return ClaimResult(claim, not_run(f"it needs a GPU (`{command}` on a machine with one)"))
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
        return ClaimResult(claim, failed(f"{type(error).__name__}: {error}"))
    measured = _measured(bench, entrants, settings)
    try:
        verdict = judge(claim, measured, target.metric)
    except AllRepeatsCrashedError as error:  # judging without it would judge against weaker rivals
        verdict = failed(str(error))
    else:
        note = learners_note(_summaries(bench, claim.candidate, settings.out))
        if note is not None:
            verdict = Verdict(verdict.status, f"{verdict.measured}; {note}", verdict.rival, verdict.spread)
    result = ClaimResult(
        claim,
        verdict,
        measured,
        [f"{entrant.name} (configs/algorithm/{entrant.algorithm}.yaml missing)" for entrant in left_out],
        bench.table,
        time.perf_counter() - started,
    )
    print(f"{claim.key}: {result.verdict.status}; {result.verdict.measured}")
    return result


def _measured(bench: BenchResult, entrants: Sequence[Entrant], settings: BenchSettings) -> list[Measured]:
    """Every repeat's figures of every entrant, in repeat order; an entrant whose repeats all crashed has none."""
    measured = []
    for entrant in entrants:
        runs = sorted((run for run in bench.runs if run.algorithm == entrant.name), key=lambda run: run.repeat)
        finished = [run for run in runs if run.error is None]
        epochs = tuple(
            None
            if run.record is None
            else epochs_to_target(RunRecord.load(settings.out / run.record), settings.target, settings.epochs)
            for run in finished
        )
        measured.append(
            Measured(
                entrant.name,
                times=tuple(run.time_to_target for run in finished),
                epochs=epochs,
                finals=tuple(run.final_metric for run in finished),
                crashed=len(runs) - len(finished),
            )
        )
    return measured


def _summaries(bench: BenchResult, entrant: str, out: Path) -> list[dict[str, Any]]:
    """The end-of-fit summaries of ``entrant``'s finished repeats, in repeat order (where the strategy wrote one)."""
    runs = sorted((run for run in bench.runs if run.algorithm == entrant and run.record), key=lambda run: run.repeat)
    paths = [(out / str(run.record)).parent / "logs" / SUMMARY_FILE for run in runs if run.error is None]
    summaries = []
    for path in paths:
        try:
            summaries.append(json.loads(path.read_text()))
        except (OSError, ValueError):  # no summary, or a cut one: the verdict stands without its note
            continue
    return summaries


def learners_note(summaries: Sequence[Mapping[str, Any]]) -> str | None:
    """The learners per replica each repeat chose, with the chosen number's samples/s over one learner's.

    ``None`` where no summary tells of learners (one learner per replica, or another strategy).

    Example:
        >>> tuned = {"learners": {"per_replica": 4, "measured": [100.0, 180.0, 250.0, 320.0, 310.0]}}
        >>> learners_note([tuned, {"learners": {"per_replica": 2, "measured": []}}])
        'learners per replica, by repeat: 4 (auto: 3.20× the samples/s of one), 2'
    """
    chosen = []
    for summary in summaries:
        learners = summary.get("learners")
        if not isinstance(learners, Mapping) or "per_replica" not in learners:
            continue
        count, rates = int(learners["per_replica"]), learners.get("measured") or []
        if len(rates) >= count and rates[0] > 0:
            chosen.append(f"{count} (auto: {rates[count - 1] / rates[0]:.2f}× the samples/s of one)")
        else:
            chosen.append(str(count))
    return f"learners per replica, by repeat: {', '.join(chosen)}" if chosen else None


def write_report(out: Path, results: Sequence[ClaimResult], settings: dict[str, Any]) -> list[Path]:
    """Write ``seeds.md`` (summary, then each claim's race) and ``seeds.json``; returns the paths."""
    sections = [seeds_table(results), "", MACHINE_NOTE]
    for result in results:
        claim = result.claim
        sections += ["", f"## {claim.key}: {claim.title}", "", f"*{claim.source}.* {claim.statement}", ""]
        sections.append(
            f"Workload `{claim.workload}`, devices `{claim.profile}`; judged: `{claim.candidate}` against "
            + ", ".join(f"`{name}`" for name in claim.rivals)
            + f" by time to target on the training clock, repeat by repeat (reproduced only when, over at least "
            f"{MIN_REPEATS} repeats each, its slowest repeat beats every rival's fastest, at a median final metric "
            f"within {claim.tolerance:g} of the best rival's)."
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
                "verdict": asdict(r.verdict),
                "measured": [_figures(m) for m in r.measured],
                "left_out": r.left_out,
                "seconds": r.seconds,
            }
            for r in results
        ],
    }
    return [table_path, write_json(out / RESULTS_FILE, data)]


def _figures(measured: Measured) -> dict[str, Any]:
    """Every repeat's figures and their medians, JSON-ready (a non-finite number as ``null``)."""
    row = asdict(measured) | {
        "repeats": measured.repeats,
        "time_to_target": measured.time_to_target,
        "epochs_to_target": measured.epochs_to_target,
        "final_metric": measured.final_metric,
    }
    return {k: [_finite(x) for x in v] if isinstance(v, tuple | list) else _finite(v) for k, v in row.items()}


def _finite(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value


def build_parser() -> argparse.ArgumentParser:
    """The program's options."""
    parser = argparse.ArgumentParser(
        prog="aesgd-bench seeds",
        description="Reproduce the seed papers' claims (Adaptive SGD's headline, Crossbow's SMA at small batches "
        "and its learners per device, ABS-SGD's speed-up, Adaptive Hogbatch), each as a small race judged on the "
        "training clock against every fair rival (the strongest shown), repeat by repeat, with the paper's headline "
        "and a verdict, written as seeds.md and seeds.json.",
    )
    parser.add_argument("--claims", default=",".join(c.key for c in CLAIMS), help="comma list of claims to run")
    parser.add_argument("--out", type=Path, default=Path("bench_results") / "seeds", help="output directory")
    parser.add_argument(
        "--repeats",
        type=int,
        help=f"repeats of every claim's race (default: each claim's own, {Claim.repeats}); fewer than {MIN_REPEATS} "
        "can only give ties",
    )
    parser.add_argument("--quick", action="store_true", help="one repeat per claim: a smoke test, every verdict a tie")
    parser.add_argument("--epochs", type=int, help="epochs of every run (default: each workload's)")
    parser.add_argument("--target", help="target '<metric>=<value>' of every claim (default: each claim's own)")
    parser.add_argument(
        "--tiny", action="store_true", help="a seconds-long configuration (tests; one repeat unless --repeats)"
    )
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
        repeats=1 if options.quick else options.repeats or (1 if options.tiny else None),
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
    broken = [r for r in results if r.verdict.status == "failed"]
    for result in broken:
        print(f"error: claim {result.claim.key} {result.verdict.measured}", file=sys.stderr)
    return 1 if broken else 0
