"""The seeds' claims: the verdict rules, the claims' definitions, the figures they read, and a tiny run end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_aesgd.bench import main
from lightning_aesgd.bench.race.recorder import RunRecord, Validation
from lightning_aesgd.bench.race.suites import WORKLOADS, Target
from lightning_aesgd.bench.seeds.claims import CLAIMS, Claim, Entrant, algorithm_exists, get_claims
from lightning_aesgd.bench.seeds.program import ClaimResult, epochs_to_target, judge, median_or_none, seeds_table
from lightning_aesgd.bench.seeds.verdicts import Measured, Verdict, faster_verdict, not_run

# --- verdicts -------------------------------------------------------------------------------------------------


def _m(name: str, time: float | None, final: float | None = 0.93, epochs: float | None = None) -> Measured:
    return Measured(name, time_to_target=time, epochs_to_target=epochs, final_metric=final)


def test_faster_than_every_rival_at_kept_accuracy_is_reproduced():
    verdict = faster_verdict(_m("adaptive", 5.0), [_m("equal", 8.0), _m("sma", 9.0), _m("ddp", 10.0)], metric="P@1")
    assert verdict.status == "reproduced"
    assert verdict.measured == (
        "time to target: adaptive 5.0 s = 0.62× equal's, 0.56× sma's, 0.50× ddp's; final P@1 0.9300 (best rival 0.9300)"
    )


def test_a_rival_that_never_reaches_the_target_counts_as_slower():
    verdict = faster_verdict(_m("adaptive", 5.0), [_m("ddp", None, final=0.85)])
    assert verdict.status == "reproduced"
    assert "ddp not reached" in verdict.measured


def test_faster_but_less_accurate_than_tolerated_is_partly_reproduced():
    rivals = [_m("ddp", 10.0, final=0.95)]
    assert faster_verdict(_m("adaptive", 5.0, final=0.935), rivals).status == "partly reproduced"
    assert faster_verdict(_m("adaptive", 5.0, final=0.945), rivals).status == "reproduced"  # within 0.01
    assert faster_verdict(_m("adaptive", 5.0, final=0.935), rivals, tolerance=0.02).status == "reproduced"


def test_faster_than_some_rivals_only_is_partly_reproduced():
    assert faster_verdict(_m("adaptive", 5.0), [_m("sma", 4.0), _m("ddp", 10.0)]).status == "partly reproduced"


def test_slower_than_every_rival_or_never_there_is_not_reproduced():
    assert faster_verdict(_m("adaptive", 5.0), [_m("ddp", 5.0)]).status == "not reproduced"  # a tie is no gain
    assert faster_verdict(_m("adaptive", None), [_m("ddp", 5.0)]).status == "not reproduced"


def test_nobody_at_the_target_is_inconclusive():
    verdict = faster_verdict(_m("adaptive", None), [_m("ddp", None)])
    assert verdict.status == "inconclusive"
    assert verdict.measured.startswith("time to target: adaptive not reached; ddp not reached")


def test_margin_demands_a_given_speed_up():
    assert faster_verdict(_m("abs", 9.0), [_m("ddp", 10.0)], margin=1 / 1.3).status == "not reproduced"
    assert faster_verdict(_m("abs", 7.0), [_m("ddp", 10.0)], margin=1 / 1.3).status == "reproduced"


def test_epochs_are_judged_by_epochs_not_time():
    small = Measured("sma_b64", time_to_target=20.0, epochs_to_target=0.5, final_metric=0.93)
    large = Measured("ddp_b512", time_to_target=10.0, epochs_to_target=2.0, final_metric=0.90)
    verdict = faster_verdict(small, [large], kind="epochs")
    assert verdict.status == "reproduced"
    assert verdict.measured.startswith("epochs to target: sma_b64 0.50 epochs = 0.25× ddp_b512's")
    assert faster_verdict(small, [large], kind="time").status == "not reproduced"


def test_a_claim_needs_a_rival():
    with pytest.raises(ValueError, match="rival"):
        faster_verdict(_m("adaptive", 1.0), [])
    assert not_run("algorithm missing") == Verdict("not run", "not run: algorithm missing")


# --- claims ---------------------------------------------------------------------------------------------------


def test_every_claim_is_well_formed():
    assert [claim.key for claim in CLAIMS] == ["adaptive_sgd", "crossbow", "abs_sgd"]
    for claim in CLAIMS:
        names = [entrant.name for entrant in claim.entrants]
        assert len(set(names)) == len(names), claim.key
        assert claim.candidate in names, claim.key
        assert set(claim.rivals) <= set(names), claim.key
        assert claim.candidate not in claim.rivals, claim.key
        assert claim.workload in WORKLOADS, claim.key
        assert claim.statement, claim.key
        assert claim.source, claim.key
        for entrant in claim.entrants:  # every entrant runs an algorithm config (or is optional / required)
            assert entrant.optional or entrant.algorithm in claim.requires or algorithm_exists(entrant.algorithm)


def test_the_headline_races_equal_batches_of_the_same_algorithm():
    claim = get_claims(["adaptive_sgd"])[0]
    equal = next(e for e in claim.entrants if e.name == "adaptive_sgd_equal")
    assert equal.selection() == ["algorithm=adaptive_sgd", "algorithm.planner=static"]
    assert Entrant("sma").selection() == ["algorithm=sma"]
    assert (claim.profile, claim.pace) == ("strong", "time")


def test_abs_sgd_lights_up_when_its_config_exists(tmp_path: Path):
    claim = get_claims(["abs_sgd"])[0]
    (tmp_path / "algorithm").mkdir()
    assert claim.missing(tmp_path) == ["abs_sgd"]
    (tmp_path / "algorithm" / "abs_sgd.yaml").write_text("{}\n")
    assert claim.missing(tmp_path) == []
    kept, left_out = claim.present_entrants(tmp_path)
    assert [e.name for e in kept] == ["abs_sgd", "ddp"]
    assert [e.name for e in left_out] == ["sync_adaptive"]
    (tmp_path / "algorithm" / "sync_adaptive.yaml").write_text("{}\n")
    assert [e.name for e in claim.present_entrants(tmp_path)[0]] == ["abs_sgd", "ddp", "sync_adaptive"]


def test_unknown_claims_are_named():
    with pytest.raises(KeyError, match="no_such_claim"):
        get_claims(["no_such_claim"])


# --- figures --------------------------------------------------------------------------------------------------


def test_epochs_to_target_counts_the_samples_before_the_validation():
    validations = [
        Validation(1.0, 1, 0, {"val/p@1": 0.2}),
        Validation(2.0, 3, 1, {"val/p@1": 0.7}),
        Validation(3.0, 4, 1, {"val/p@1": 0.9}),
    ]
    record = RunRecord(2, [1.0, 2.0, 3.0, 4.0], [100, 100, 100, 100], validations)
    assert epochs_to_target(record, Target("val/p@1", 0.6), epochs=2) == pytest.approx(1.5)
    assert epochs_to_target(record, Target("val/p@1", 0.95), epochs=2) is None
    assert epochs_to_target(RunRecord(), Target("val/p@1", 0.6), epochs=2) is None


def test_medians_count_a_missed_target_as_infinitely_late():
    assert median_or_none([3.0, 1.0, 2.0]) == 2.0
    assert median_or_none([1.0, None]) is None  # the median of 1 and ∞
    assert median_or_none([]) is None


def test_judge_skips_controls_and_missing_entrants():
    claim = get_claims(["crossbow"])[0]
    measured = [
        Measured("sma_b64", epochs_to_target=0.5, final_metric=0.93),
        Measured("ddp_b512", epochs_to_target=1.0, final_metric=0.92),
        Measured("ddp_b64", epochs_to_target=0.1, final_metric=0.99),  # the control would win, but is not judged
    ]
    verdict = judge(claim, measured, "val/p@1")
    assert verdict.status == "reproduced"
    assert verdict.measured.endswith("; control (not judged): ddp_b64 0.10 epochs, final 0.9900")
    assert judge(claim, measured[1:], "val/p@1").status == "not run"  # the candidate failed
    assert judge(claim, measured[:1], "val/p@1").measured == "not run: no rival ran"


def test_seeds_table_has_one_row_per_claim():
    claim = Claim("k", "A title", "Someone, 2020", "It is fast.", "xmc_mini", "strong", "a", ("b",), (Entrant("a"),))
    table = seeds_table([ClaimResult(claim, Verdict("reproduced", "a 1.0 s = 0.50× b's"))])
    assert table.splitlines() == [
        "| claim | paper says | we measured | verdict |",
        "|---|---|---|---|",
        "| A title (Someone, 2020) | It is fast. | a 1.0 s = 0.50× b's | **reproduced** |",
    ]


# --- end to end -----------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tiny_seeds_run_writes_the_table_and_verdicts(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    # A target every entrant reaches in the tiny data set, so that every run claim gets a real verdict.
    argv = ["seeds", "--tiny", "--claims", "crossbow,abs_sgd", "--target", "val/p@1=0.05", "--out", str(tmp_path)]
    assert main(argv) == 0

    results = json.loads((tmp_path / "seeds.json").read_text())
    claims = {claim["key"]: claim for claim in results["claims"]}
    assert list(claims) == ["crossbow", "abs_sgd"]
    crossbow = claims["crossbow"]
    assert crossbow["verdict"]["status"] in {"reproduced", "partly reproduced", "not reproduced"}
    assert [m["name"] for m in crossbow["measured"]] == ["sma_b64", "ddp_b512", "ddp_b64"]
    assert all(m["epochs_to_target"] is not None and m["final_metric"] is not None for m in crossbow["measured"])
    if not algorithm_exists("abs_sgd"):
        assert claims["abs_sgd"]["verdict"]["measured"].startswith("not run: algorithm missing")

    table = (tmp_path / "seeds.md").read_text()
    assert table.startswith("| claim | paper says | we measured | verdict |")
    assert "## crossbow:" in table
    assert "| homogeneous | sma_b64 |" in table  # the claim's own race table
    assert (tmp_path / "crossbow" / "results.json").is_file()
    assert "| claim | paper says | we measured | verdict |" in capsys.readouterr().out
