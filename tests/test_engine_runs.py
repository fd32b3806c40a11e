"""`specctl bench engine-runs`: several engine benchmark runs read together (bench.engine_runs)."""

import json

import pytest

from bench.engine_runs import cross_run, default_run_folders, load_cells, run_engine_runs, sign_test_p
from specctl.cli import main


def _write_run(folder, warm_second, warm_main=1.0, gap=0.05, second_pass=True, passes=None, alone_second=None):
    """An engine.json with one cell per (drafter, batch) of ``warm_second``: {(drafter, batch): ratio};
    ``passes``: its ``passes`` key (batch -> passes: run R's), absent by default as in the other runs;
    ``alone_second``: a run warmed in the crowd with a ``warm-alone`` controller beside it (``--warmup
    both``), its second-pass ratios by cell."""
    folder.mkdir(parents=True)
    rows, acceptance = [], []
    for (drafter, batch), ratio in warm_second.items():
        row = {"drafter": drafter, "batch": batch, "best_static": "static-d1", "best_static_speedup": 1.05,
               "warm_vs_best_static_or_plain": warm_main, "cold_vs_best_static_or_plain": 0.97}
        if second_pass:
            row["second_pass"] = {"best_static": "static-d1", "best_static_speedup": 1.04,
                                  "warm_vs_best_static_or_plain": ratio, "cold_vs_best_static_or_plain": None}
        if alone_second:
            row["warm-alone_vs_best_static_or_plain"] = 0.9
            row["second_pass"]["warm-alone_vs_best_static_or_plain"] = alone_second[(drafter, batch)]
        rows.append(row)
        acceptance.append({"drafter": drafter, "batch": batch, "warmup_top1_rates": [0.3 + gap, 0.5],
                           "eval_top1_rates": [0.3, 0.5]})
    result = {"static_vs_controller": rows, "acceptance_warmup_vs_eval": acceptance}
    if passes:
        result["passes"] = {str(b): n for b, n in passes.items()}
    if alone_second:
        result["controller_warmup"] = {"warm": "crowd", "warm-alone": "alone"}
    (folder / "engine.json").write_text(json.dumps(result))
    return folder


def test_sign_test_is_exact_and_two_sided():
    assert sign_test_p(0, 0) == 1.0
    assert sign_test_p(0, 6) == sign_test_p(6, 6) == pytest.approx(2 / 64)
    assert sign_test_p(3, 10) == pytest.approx(2 * (1 + 10 + 45 + 120) / 1024)
    with pytest.raises(ValueError, match="under=7, n=6"):
        sign_test_p(7, 6)


def test_a_cell_behind_in_every_run_is_told_from_one_that_is_tied(tmp_path):
    # eagle b8 under 1 in all five runs; ngram b1 on both sides of 1 (a tie); medusa b4 missing in one run
    behind = [0.96, 0.97, 0.95, 0.98, 0.955]
    tied = [1.01, 0.99, 1.02, 0.985, 1.0]
    folders = []
    for i in range(5):
        cells = {("eagle", 8): behind[i], ("ngram", 1): tied[i]}
        if i != 2:
            cells[("medusa", 4)] = 0.99
        folders.append(_write_run(tmp_path / f"engine-run{i + 7}", cells, gap=0.02 * i))
    cells = [c for f in folders for c in load_cells(f)]
    summaries, overall = cross_run(cells)
    by = {(s.drafter, s.batch): s for s in summaries}
    assert [(s.drafter, s.batch) for s in summaries] == [("ngram", 1), ("medusa", 4), ("eagle", 8)]  # batch, drafter
    eagle = by[("eagle", 8)]
    signs = eagle.signs["warm-second"]
    assert (signs.under, signs.counted) == (5, 5)
    assert signs.sign_p == pytest.approx(1 / 16)
    assert signs.mean == pytest.approx(sum(behind) / 5, abs=1e-4)
    ngram = by[("ngram", 1)]
    signs = ngram.signs["warm-second"]
    assert (signs.under, signs.counted, signs.sign_p) == (2, 4, 1.0)  # the run at exactly 1 is no sign
    assert by[("medusa", 4)].runs == ["engine-run7", "engine-run8", "engine-run10", "engine-run11"]
    assert eagle.acceptance_gaps == pytest.approx([0.0, 0.02, 0.04, 0.06, 0.08])
    # the main pass's ratios are all exactly 1 here: no signs at all
    assert list(overall) == ["alone"]  # runs before stop 39 warmed alone
    assert overall["alone"]["warm-main"]["counted"] == 0 and overall["alone"]["warm-main"]["sign_p"] == 1.0
    assert overall["alone"]["warm-second"]["under"] == 5 + 2 + 4
    assert overall["alone"]["cold-second"]["cells"] == 0 and overall["alone"]["cold-second"]["mean"] is None


def test_a_warm_up_in_the_crowd_is_a_cell_of_its_own_and_a_run_with_both_feeds_each(tmp_path):
    old = _write_run(tmp_path / "engine-run17", {("eagle", 8): 0.95})
    both = _write_run(tmp_path / "engine-run19", {("eagle", 8): 1.01}, alone_second={("eagle", 8): 0.96})
    cells = load_cells(both)
    assert [(c.warmup, c.ratios["warm-second"], c.ratios["cold-main"]) for c in cells] == [
        ("crowd", 1.01, 0.97), ("alone", 0.96, None)]  # the cold controller counted once, with the crowd's
    assert [c.acceptance_gap for c in cells] == [pytest.approx(0.05), None]  # the warm-up counted is the crowd's
    summaries, overall = cross_run(load_cells(old) + cells)
    by = {(s.warmup, s.drafter, s.batch): s for s in summaries}
    assert [s.warmup for s in summaries] == ["alone", "crowd"]
    assert by[("alone", "eagle", 8)].values["warm-second"] == [0.95, 0.96]
    assert by[("alone", "eagle", 8)].runs == ["engine-run17", "engine-run19"]
    assert by[("crowd", "eagle", 8)].values["warm-main"] == [1.0]
    assert overall["alone"]["warm-second"]["under"] == 2 and overall["crowd"]["warm-second"]["under"] == 0
    assert overall["alone"]["cold-main"]["cells"] == 1 and overall["crowd"]["cold-main"]["cells"] == 1


def test_a_batch_kept_full_is_never_pooled_with_a_batch_draining(tmp_path):
    drain = _write_run(tmp_path / "engine-run16", {("eagle", 8): 0.95, ("eagle", 1): 1.0})
    full = _write_run(tmp_path / "engine-run18", {("eagle", 8): 1.02, ("eagle", 1): 0.99}, passes={1: 1, 8: 4})
    summaries, _ = cross_run(load_cells(drain) + load_cells(full))
    cells = {(s.drafter, s.batch, s.passes): s.values["warm-second"] for s in summaries}
    assert cells == {("eagle", 1, 1): [1.0, 0.99], ("eagle", 8, 1): [0.95], ("eagle", 8, 4): [1.02]}


def test_the_command_writes_json_and_png_and_refuses_what_it_cannot_read(tmp_path, capsys):
    a = _write_run(tmp_path / "engine-run9", {("eagle", 8): 0.95})
    b = _write_run(tmp_path / "engine-run10", {("eagle", 8): 0.97})
    _write_run(tmp_path / "engine-run5", {("eagle", 8): 0.9}, second_pass=False)  # before the second pass
    assert default_run_folders(tmp_path) == [a, b]  # run 9 before run 10, and no run without a second pass
    out = tmp_path / "out"
    assert main(["bench", "engine-runs", "--runs", f"{a},{b}", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "eagle        8  1 alone   second   2/2" in printed
    result = json.loads((out / "engine-runs.json").read_text())
    assert result["runs"] == ["engine-run9", "engine-run10"]
    assert result["cells"][0]["values"]["warm-second"] == [0.95, 0.97]
    assert (out / "engine-runs.png").stat().st_size > 0

    assert main(["bench", "engine-runs", "--runs", str(a), "--out", str(out)]) == 2
    assert "two run folders or more, got 1" in capsys.readouterr().err
    bad = tmp_path / "engine-run11"
    bad.mkdir()
    (bad / "engine.json").write_text(json.dumps({"runs": []}))
    assert main(["bench", "engine-runs", "--runs", f"{a},{bad}", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "engine-run11/engine.json" in err and "static_vs_controller" in err
    with pytest.raises(ValueError, match="two run folders"):
        run_engine_runs([a], out)


def test_challenger_runs_pool_their_paired_ratios_per_policy_file(tmp_path, capsys):
    folders = []
    for i, (path, main_ratio, second_ratio) in enumerate(
            [("bench/challengers/a.yaml", 1.04, 0.99), ("bench/challengers/a.yaml", 1.02, 1.03),
             ("bench/challengers/b.yaml", 0.95, 0.97), (None, None, None)]):
        folder = _write_run(tmp_path / f"engine-run{i + 1}", {("eagle", 8): 0.97, ("eagle", 4): 1.0})
        result = json.loads((folder / "engine.json").read_text())
        if path:
            result["challenger_policy"] = {"path": path, "fields": {"policy": "goodput"}}
            for row in result["static_vs_controller"]:
                row["challenger_vs_warm"] = main_ratio
                row["second_pass"]["challenger_vs_warm"] = second_ratio
        (folder / "engine.json").write_text(json.dumps(result))
        folders.append(folder)
    out = tmp_path / "out"
    assert run_engine_runs(folders, out, plot=False) == 0
    challengers = json.loads((out / "engine-runs.json").read_text())["challengers"]
    assert set(challengers) == {"bench/challengers/a.yaml", "bench/challengers/b.yaml"}  # the run without: none
    a = challengers["bench/challengers/a.yaml"]
    assert a["runs"] == ["engine-run1", "engine-run2"] and len(a["pairs"]) == 2 * 2 * 2  # runs x cells x passes
    assert (a["all"]["under"], a["all"]["counted"]) == (2, 8)  # the 0.99s: behind
    assert a["by_batch"]["8"]["second"]["mean"] == pytest.approx(1.01)
    assert challengers["bench/challengers/b.yaml"]["all"]["under"] == 4
    assert "challenger bench/challengers/a.yaml" in capsys.readouterr().out
