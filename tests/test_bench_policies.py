"""``specctl bench policies`` on a tiny scenario: fields, determinism, the oracle's ceiling,
and the controller path's plan delivery delay."""

from __future__ import annotations

import json

import pytest
import yaml

from bench.policies import (
    ControlledFleet,
    Job,
    Series,
    compress_time,
    drive,
    fleet_metrics,
    run_job,
    run_policy_bench,
)
from controller.config import ServerConfig
from policies.presets import load_preset_text
from worker.sim.scenario import ScenarioError, load_scenario, scenario_from_dict
from worker.sim.worker import SimWorker

POLICIES = ["goodput", "static", "trtllm-gate"]
FIELDS = {"goodput_tok_s", "tpot_ms_mean", "tpot_ms_p99", "mean_accepted", "spec_fraction", "vs_oracle",
          "vs_best_static", "request_tok_s"}


def tiny(duration_s: float = 5.0) -> dict:
    """One H100 + a small EAGLE drafter at low load, code drifting mid-run."""
    return {
        "name": "tiny",
        "duration_s": duration_s,
        "seed": 5,
        "domain_acceptance": {"chat": 1.0, "code": 1.08},
        "traffic": {
            "arrivals": {"kind": "poisson", "rate": 3.0},
            "prompt_len": {"kind": "lognormal", "median": 400, "sigma": 0.5, "max": 4000},
            "output_len": {"kind": "lognormal", "median": 64, "sigma": 0.4, "min": 8, "max": 256},
            "domain_mix": {"chat": 0.5, "code": 0.5},
        },
        "workers": [{"id": "w", "hardware": "H100-SXM", "max_batch_size": 64,
                     "drafter": {"kind": "eagle", "version": "t", "max_depth": 4, "max_width": 4, "max_nodes": 16,
                                 "trained_context_len": 8192}}],
        "changes": [{"at_s": duration_s / 2, "kind": "drift", "domain": "code", "factor": 0.8}],
    }


def saturated(duration_s: float = 3.0) -> dict:
    """The tiny fleet, overloaded: the batch stays full (32), goodput is the worker's
    capacity and each step averages 32 requests' outcomes, so the oracle's edge
    (true acceptance per request, exact cost) stands well clear of sampling noise."""
    data = tiny(duration_s)
    data["traffic"]["arrivals"]["rate"] = 200.0
    data["workers"][0]["max_batch_size"] = 32
    return data


def bench(tmp_path, name: str, plots: bool = False) -> dict:
    return run_policy_bench(out_dir=tmp_path / name, jobs=1, presets=POLICIES, grid_depths=(0, 2, 4),
                            grid_widths=(1, 2), scout=False, plots=plots,
                            scenario_data_override={"tiny": saturated()})


def numbers(report: dict) -> dict:
    """The report without wall-clock times (everything else must repeat exactly)."""
    out = json.loads(json.dumps(report["scenarios"]))
    for entry in out["tiny"]["policies"].values():
        entry.pop("wall_s")
    return out


def test_tiny_suite_fields_determinism_and_oracle_ceiling(tmp_path):
    first = bench(tmp_path, "a", plots=True)
    entry = first["scenarios"]["tiny"]
    policies = entry["policies"]
    assert set(policies) == set(POLICIES) | {"best_static", "oracle"}
    for name, p in policies.items():
        assert FIELDS <= set(p), name
        assert p["goodput_tok_s"] > 0 and 0.0 <= p["spec_fraction"] <= 1.0
        assert p["tpot_ms_p99"] >= p["tpot_ms_mean"] > 0
    assert policies["oracle"]["vs_oracle"] == 1.0 and policies["best_static"]["vs_best_static"] == 1.0
    # best_static is the grid point with the highest goodput, and says which it was.
    best = max(g["goodput_tok_s"] for g in entry["grid"])
    assert policies["best_static"]["goodput_tok_s"] == best
    assert policies["best_static"]["config"] in [{k: g[k] for k in ("depth", "width", "max_nodes")} for g in entry["grid"]]
    assert len(entry["grid"]) == 5  # off + depth {2, 4} x width {1, 2}
    # Every preset ran through the controller: plans reached the worker and were ACKed.
    for name in POLICIES:
        assert policies[name]["controller"]["plans_applied"] >= 1, name
        assert policies[name]["controller"]["rejections"] == 0, name
    # The oracle is the ceiling.
    for name, p in policies.items():
        assert policies["oracle"]["goodput_tok_s"] >= p["goodput_tok_s"], name
    # Same seed, same numbers.
    assert numbers(bench(tmp_path, "b")) == numbers(first)
    written = json.loads((tmp_path / "a" / "policies.json").read_text())
    assert numbers(written) == numbers(first)
    assert (tmp_path / "a" / "policies.png").stat().st_size > 0
    assert (tmp_path / "a" / "policies-speed.png").stat().st_size > 0
    assert (tmp_path / "a" / "policies-series-tiny.png").stat().st_size > 0
    series = json.loads((tmp_path / "a" / "policies-series.json").read_text())["tiny"]
    assert {"goodput_tok_s", "mean_depth", "t_s"} <= set(series["goodput"])
    assert any(a is not None for a in series["oracle"]["true_alpha1"])


@pytest.mark.parametrize("delay", [0, 3])
def test_plans_reach_the_worker_after_the_configured_delay(delay):
    scenario = scenario_from_dict(tiny(duration_s=1.0))
    workers = SimWorker.fleet(scenario)
    policy = load_preset_text("policy: static\ndepth: 2\nwidth: 1\n")
    fleet = ControlledFleet(workers, policy, ServerConfig(), delay_steps=delay)
    depths: list[int] = []

    def after(i, result):
        depths.append(max(r.depth for r in result.telemetry.requests))
        fleet.after(i, result)

    drive(workers, [link.decide for link in fleet.links], scenario.duration_s, after=after)
    # The first plan is made after the first step; it is in force `delay` steps later.
    assert depths[: 1 + delay] == [0] * (1 + delay)
    assert set(depths[1 + delay :]) == {2}
    state = fleet.controller.workers["w"]
    assert state.plans.acked_version == fleet.links[0].version >= 1 and not state.plans.pending


def test_compress_time_scales_the_clock_not_the_load():
    data = tiny(10.0)
    data["traffic"]["arrivals"] = {"kind": "bursty", "rate_on": 20, "rate_off": 2, "mean_on_s": 4, "mean_off_s": 6}
    short = compress_time(data, 0.5)
    assert short["duration_s"] == 5.0 and short["changes"][0]["at_s"] == 2.5
    assert short["traffic"]["arrivals"] == {"kind": "bursty", "rate_on": 20, "rate_off": 2, "mean_on_s": 2.0,
                                            "mean_off_s": 3.0}
    assert data["duration_s"] == 10.0  # the original is untouched
    scenario_from_dict(short)


def test_series_bins_add_up_to_the_totals():
    scenario = scenario_from_dict(tiny(duration_s=2.0))
    workers = SimWorker.fleet(scenario)
    series = Series(scenario.duration_s, bins=4)
    from policies.table import Decision

    drive(workers, [lambda rid, ctx, b: Decision.chain(3)], scenario.duration_s, after=lambda i, r: series.add(r))
    metrics = fleet_metrics(workers)
    assert series.data[0].sum() == metrics["tokens"]
    assert series.data[1].sum() == pytest.approx(metrics["busy_s"], abs=1e-3)
    exported = series.export()
    assert len(exported["t_s"]) == 4 and exported["mean_depth"][0] == pytest.approx(3.0)


# vLLM issue 49548's reporter's table: K=2 up to 4 requests, speculation off from 5.
ISSUE_TABLE = {"num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": [[1, 4, 2], [5, 512, 0]]}


def test_scenario_preset_config_changes_what_the_preset_decides():
    """The same preset on the same saturated batch (32 requests), without and with the
    scenario's override: the file's table drafts at every batch size, the override's
    turns speculation off from 5 requests."""
    data = saturated(2.0)
    plain = run_job(Job("tiny", "preset", "vllm-batch-table", data))
    configured = dict(data, preset_config={"vllm-batch-table": ISSUE_TABLE})
    scenario_from_dict(configured)  # a valid override
    over = run_job(Job("tiny", "preset", "vllm-batch-table", configured))
    assert plain["spec_fraction"] > 0.9 and plain["controller"]["plans_applied"] >= 1
    assert over["spec_fraction"] < 0.05 and over["controller"]["plans_applied"] >= 1
    assert over["tokens"] != plain["tokens"]


def test_shipped_cliff_scenario_runs_vllm_with_the_issues_table():
    scenario = load_scenario("threshold-cliff")
    assert scenario.preset_config == {"vllm-batch-table": ISSUE_TABLE}
    assert set(scenario.preset_config) == {"vllm-batch-table"}  # trtllm-concurrency keeps its documented schedule


@pytest.mark.parametrize(
    "preset_config, expected",
    [
        ({"vllm-batch-table": {"num_speculative_tokens_per_batch_size": [[1, 4, 2], [5, 512, 99]]}},
         "'num_speculative_tokens_per_batch_size.1.2' = 99"),
        ({"vllm-batch-table": {"num_speculative_tokens": 2, "table": [[1, 4, 2]]}}, "unknown key 'table'"),
        ({"trtllm-concurrency": {"max_concurrency": 8}}, "max_concurrency and draft_len_schedule are mutually exclusive"),
        ({"vllm-batch-tabel": ISSUE_TABLE}, "unknown preset 'vllm-batch-tabel'"),
    ],
)
def test_bad_preset_config_is_refused_before_any_run(tmp_path, preset_config, expected):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(dict(tiny(), preset_config=preset_config)))
    with pytest.raises(ScenarioError) as err:
        run_policy_bench([path], tmp_path / "out", jobs=1, presets=["vllm-batch-table"], plots=False)
    message = str(err.value)
    assert str(path) in message and f"preset_config.{next(iter(preset_config))}" in message
    assert expected in message
    assert not (tmp_path / "out" / "policies.json").exists()


def test_quick_cli_run_writes_results_and_goal_verdicts(tmp_path):
    """``specctl bench policies --quick`` as CI runs it, on one shipped scenario and
    three presets, in a real subprocess."""
    import subprocess
    import sys

    out = tmp_path / "quick"
    proc = subprocess.run(
        [sys.executable, "-m", "specctl.cli", "bench", "policies", "--quick", "--scenario", "threshold-cliff",
         "--policies", "goodput", "vllm-batch-table", "trtllm-concurrency", "--jobs", "1", "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((out / "policies.json").read_text())
    assert report["meta"]["quick"] is True and report["meta"]["time_scale"] == 0.04
    entry = report["scenarios"]["threshold-cliff"]
    assert set(entry["policies"]) == {"goodput", "vllm-batch-table", "trtllm-concurrency", "best_static", "oracle"}
    assert entry["preset_config"] == {"vllm-batch-table": ISSUE_TABLE}  # the table the vLLM preset ran with
    goals = entry["goals"]
    assert {"vs_oracle>=0.95", "vs_best_baseline>=0.98", "vs_vllm-batch-table>=1.3",
            "vs_trtllm-concurrency>=1.3"} <= set(goals)
    policies = entry["policies"]
    for key, goal in goals.items():
        assert goal["met"] == (goal["value"] >= float(goal_threshold(goal, goals)))
    for rival in ("vllm-batch-table", "trtllm-concurrency"):  # the oracle's own ratio: what any policy could reach
        ceiling = goals[f"vs_{rival}>=1.3"]["ceiling"]
        oracle_ratio = policies["oracle"]["goodput_tok_s"] / policies[rival]["goodput_tok_s"]
        assert ceiling == pytest.approx(oracle_ratio, abs=1e-3)
    oracle = entry["policies"]["oracle"]["goodput_tok_s"]
    assert all(p["goodput_tok_s"] <= oracle * 1.02 for p in entry["policies"].values())
    assert (out / "policies-series-threshold-cliff.png").stat().st_size > 0
    assert "threshold-cliff" in proc.stdout


def goal_threshold(goal: dict, goals: dict) -> str:
    name = next(k for k, v in goals.items() if v is goal)
    return name.rsplit(">=", 1)[1]


def test_seeds_run_a_seeded_preset_once_per_seed_and_report_the_mean(tmp_path):
    """--seeds: the goodput preset (it has a `seed`) runs once per seed, each run the
    one run_job gives for that seed, and its entry is their mean with each seed's
    goodput and ratio to the oracle; a preset without a seed runs once."""
    data = saturated(2.0)
    report = run_policy_bench(out_dir=tmp_path / "s", jobs=1, presets=["goodput", "static"], grid_depths=(0, 2),
                              grid_widths=(1,), scout=False, plots=False, scenario_data_override={"tiny": data},
                              seeds=(3, 1))
    assert report["meta"]["policy_seeds"] == [3, 1]
    policies = report["scenarios"]["tiny"]["policies"]
    goodput, oracle = policies["goodput"], policies["oracle"]["goodput_tok_s"]
    assert list(goodput["seeds"]) == ["3", "1"] and "seeds" not in policies["static"]
    for seed in (3, 1):
        alone = run_job(Job("tiny", "preset", "goodput", data, seed=seed))
        assert goodput["seeds"][str(seed)]["goodput_tok_s"] == alone["goodput_tok_s"], seed
        assert goodput["seeds"][str(seed)]["vs_oracle"] == round(alone["goodput_tok_s"] / oracle, 4)
    runs = [goodput["seeds"][s]["goodput_tok_s"] for s in ("3", "1")]
    assert goodput["goodput_tok_s"] == pytest.approx(sum(runs) / 2, abs=1e-3)
    assert goodput["vs_oracle"] == round(goodput["goodput_tok_s"] / oracle, 4)
    assert goodput["vs_oracle_min"] == min(goodput["seeds"][s]["vs_oracle"] for s in ("3", "1"))
    with pytest.raises(ValueError, match=r"seeds: \[2, 2\] must be distinct"):
        run_policy_bench(out_dir=tmp_path / "bad", jobs=1, presets=["goodput"], plots=False,
                         scenario_data_override={"tiny": data}, seeds=[2, 2])
