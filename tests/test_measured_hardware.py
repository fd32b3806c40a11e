"""Measured GPU step costs as the simulator's truth (worker.sim.measured), and the
benchmark oracle staying the ceiling on that truth as on the roofline."""

from __future__ import annotations

import io
import json
import math

import numpy as np
import pytest
import yaml
from rich.console import Console

from bench.policies import run_policy_bench, with_hardware
from policies.table import Decision
from worker.sim.hardware import HARDWARE_PROFILES, CostModel
from worker.sim.measured import TABLE_DIR, MeasuredCostModel, load_table
from worker.sim.runner import run_simulated
from worker.sim.scenario import ScenarioError, load_scenario, scenario_from_dict
from worker.sim.worker import SimWorker
from tests.test_bench_policies import tiny

TABLE = json.loads((TABLE_DIR / "h200-llama3-8b.json").read_text())
BATCHES = sorted({r["batch"] for r in TABLE["verify"]})
TOKENS = sorted({r["tokens_per_request"] for r in TABLE["verify"]})
CONTEXTS = sorted({r["context"] for r in TABLE["verify"]})


@pytest.fixture(scope="module")
def cost() -> MeasuredCostModel:
    return MeasuredCostModel("H200-measured")


# -- the interpolation ---------------------------------------------------------
def test_every_measured_point_comes_back_exactly(cost):
    for r in TABLE["verify"]:
        got = cost.verify_ms(r["batch_tokens"], r["kv_tokens"], batch=r["batch"])
        assert got == pytest.approx(r["verify_ms"], rel=1e-9, abs=0), r
    for r in TABLE["draft"]:
        got = float(cost.table.draft(r["batch"], r["width"], r["context"]))
        assert got == pytest.approx(r["draft_level_ms"], rel=1e-9, abs=0), r
    # Through the drafting path: level 1 at width 1, level 2 at the requests' width.
    b, w, c = 64, 4, 8192
    two_levels = cost.draft_ms([2] * b, [w] * b, [c] * b)
    expected = sum(r["draft_level_ms"] for r in TABLE["draft"]
                   if r["batch"] == b and r["context"] == c and r["width"] in (1, w))
    assert two_levels == pytest.approx(expected, rel=1e-9)


def test_monotone_in_tokens_and_context_along_the_grid(cost):
    q_line = np.geomspace(1, 2 * TOKENS[-1], 120)
    c_line = np.geomspace(CONTEXTS[0] / 4, 4 * CONTEXTS[-1], 120)
    for b in BATCHES:
        for c in CONTEXTS:
            ms = cost.verify_ms(b * q_line, b * c, batch=b)
            assert np.all(np.diff(ms) >= -1e-12), (b, c)
        for q in TOKENS:
            ms = cost.verify_ms(b * q, b * c_line, batch=b)
            assert np.all(np.diff(ms) >= -1e-12), (b, q)
            assert np.all(ms > 0)


def test_vectorised_prices_equal_scalar_ones(cost):
    rng = np.random.default_rng(3)
    n = 300
    b = rng.integers(1, 600, n).astype(float)
    t = b * rng.uniform(1, 70, n)
    k = b * np.exp(rng.uniform(np.log(50), np.log(200_000), n))
    many = cost.verify_ms(t, k, b * 0.0, batch=b)
    assert many.shape == (n,)
    one_by_one = [cost.verify_ms(float(x), float(y), 0.0, batch=float(z)) for x, y, z in zip(t, k, b)]
    assert np.allclose(many, one_by_one, rtol=1e-12, atol=0)
    # Broadcasting as the oracle does: a [caps, prefixes] block against a scalar KV and batch.
    block = cost.verify_ms(np.arange(1, 41.0).reshape(4, 10) + 8, 8 * 3000.0, np.zeros((4, 1)), batch=8)
    assert block.shape == (4, 10)
    assert block[2, 3] == cost.verify_ms(8 + 24.0, 8 * 3000.0, batch=8)
    # Nothing to verify costs nothing, scalar or array.
    assert cost.verify_ms(0, 1000, batch=1) == 0.0
    assert cost.verify_ms(np.array([0.0, 4.0]), 4000.0, batch=4)[0] == 0.0
    # Drafting, per-level aggregates vectorised over leading axes.
    count = np.array([[4.0, 4.0, 2.0], [8.0, 0.0, 0.0]])
    width_sum = np.array([[4.0, 12.0, 8.0], [8.0, 0.0, 0.0]])
    kv = np.array([[4000.0, 4000.0, 3000.0], [16000.0, 0.0, 0.0]])
    rows = cost.draft_levels_ms(count, width_sum, kv)
    assert np.allclose(rows, [cost.draft_levels_ms(c, w, k) for c, w, k in zip(count, width_sum, kv)], rtol=1e-12)


def test_extrapolation_is_finite_and_never_below_the_edge(cost):
    for b in BATCHES:
        for q in TOKENS:
            edge_c = max(c for c in CONTEXTS if any(r["batch"] == b and r["context"] == c for r in TABLE["verify"]))
            at_edge = cost.verify_ms(b * q, b * edge_c, batch=b)
            for c in (2 * CONTEXTS[-1], 4 * CONTEXTS[-1]):
                beyond = cost.verify_ms(b * q, b * c, batch=b)
                assert math.isfinite(beyond) and beyond >= at_edge
            low = cost.verify_ms(b * q, 0, batch=b)  # below the grid's shortest context
            assert 0 < low <= cost.verify_ms(b * q, b * CONTEXTS[0], batch=b)
        for c in CONTEXTS[:1]:
            at_edge = cost.verify_ms(b * TOKENS[-1], b * c, batch=b)
            for q in (32, 65, 1000):
                beyond = cost.verify_ms(b * q, b * c, batch=b)
                assert math.isfinite(beyond) and beyond >= at_edge
    for q in TOKENS:
        at_edge = cost.verify_ms(256 * q, 256 * 1024, batch=256)
        for b in (300, 512, 4096):
            beyond = cost.verify_ms(b * q, b * 1024, batch=b)
            assert math.isfinite(beyond) and beyond >= at_edge
    for b, w, c in ((512, 8, 8192), (256, 16, 8192), (256, 8, 65536), (2000, 16, 100_000)):
        assert math.isfinite(float(cost.table.draft(b, w, c)))
        assert float(cost.table.draft(b, w, c)) >= float(cost.table.draft(min(b, 256), min(w, 8), min(c, 8192)))


def test_the_measured_curve_is_not_the_roofline(cost):
    kv = 256 * 1024
    measured = cost.verify_ms(512, kv, batch=256) / cost.verify_ms(256, kv, batch=256)
    roofline = CostModel("H200").verify_ms(512, kv) / CostModel("H200").verify_ms(256, kv)
    assert measured == pytest.approx(1.39, abs=0.01) and roofline == pytest.approx(1.89, abs=0.01)


def test_roofline_planes_are_refused_and_batch_is_required(cost):
    for call in (lambda: cost.memory_ms(1000), lambda: cost.compute_ms(10), lambda: cost.token_ms,
                 lambda: cost.regime(10, 1000)):
        with pytest.raises(NotImplementedError, match="roofline plane"):
            call()
    with pytest.raises(TypeError, match="batch="):
        cost.verify_ms(10, 1000)
    assert not cost.roofline and CostModel().roofline
    # The roofline accepts (and ignores) the batch.
    assert CostModel("H200").verify_ms(64, 64_000, batch=8) == CostModel("H200").verify_ms(64, 64_000)
    # KV capacity stays the H200's HBM.
    assert cost.kv_capacity_tokens() == CostModel("H200").kv_capacity_tokens()


def test_only_the_measured_model_and_one_gpu():
    with pytest.raises(ValueError, match="'llama-2-7b'.*llama-3-8b"):
        MeasuredCostModel("H200-measured", model="llama-2-7b")
    assert load_table("h200-llama3-8b.json").matches(MeasuredCostModel().model)


# -- scenarios -------------------------------------------------------------------
def h200_scenario(duration_s: float = 4.0, hardware: str = "H200-measured") -> dict:
    """The policy bench's tiny scenario on one H200, overloaded so the batch stays full (32)."""
    data = tiny(duration_s)
    data["name"] = "tiny-h200"
    data["traffic"]["arrivals"]["rate"] = 200.0
    data["workers"][0].update(hardware=hardware, max_batch_size=32)
    return data


def test_a_yaml_scenario_on_the_measured_table_loads_and_simulates(tmp_path):
    data = h200_scenario(duration_s=2.0)
    data["workers"][0]["noise_sigma"] = 0.0
    path = tmp_path / "h200.yaml"
    path.write_text(yaml.safe_dump(data))
    scenario = load_scenario(path)
    assert scenario.workers[0].hardware == "H200-measured"
    worker = SimWorker.fleet(scenario)[0]
    assert isinstance(worker.cost, MeasuredCostModel)
    assert worker.hello.hardware.accelerator == "H200"  # the same GPU, as its Hello says
    assert worker.kv_capacity == CostModel(HARDWARE_PROFILES["H200"]).kv_capacity_tokens()
    steps = []
    result = run_simulated(worker, lambda rid, ctx, b: Decision(3, 2, 6), scenario.duration_s,
                           on_step=lambda r: steps.append(r))
    assert result.stats.tokens > 0 and worker.stats.steps > 10
    # Without noise each step is charged exactly the table's price of its shape.
    busy = [s for s in steps if not s.idle]
    t = busy[-1].telemetry
    nodes = np.array([r.nodes for r in t.requests])
    ctx = np.array([r.context_len for r in t.requests], dtype=float)
    assert t.verify_ms == worker.cost.verify_ms(int(len(nodes) + nodes.sum()), float(ctx.sum()),
                                                 float(((1 + nodes) * ctx).sum()), batch=len(nodes))
    assert t.draft_ms == worker.cost.draft_ms([r.depth for r in t.requests], [r.width for r in t.requests], ctx)


@pytest.mark.parametrize("field, value, where", [
    ("hardware", "H200-measurd", "workers.0.hardware"),
    ("model", "llama-2-7b", "workers.0.model"),
    ("gpus", 4, "workers.0.gpus"),
])
def test_bad_hardware_settings_name_the_field_and_value(field, value, where):
    data = h200_scenario()
    data["workers"][0][field] = value
    with pytest.raises(ScenarioError) as err:
        scenario_from_dict(data)
    message = str(err.value)
    shown = repr(value) if isinstance(value, str) else str(value)
    assert where in message and shown in message, message
    if field == "hardware":
        assert "'H200-measurd'" in message and "H200-measured" in message  # the known names too


def test_bench_moves_single_gpu_h200_workers_only():
    data = load_scenario("mixed-fleet").model_dump(mode="json", exclude_none=True)
    moved_data, moved = with_hardware(data, "H200-measured")
    assert moved == [w["id"] for w in data["workers"] if w["hardware"] == "H200"]
    for before, after in zip(data["workers"], moved_data["workers"]):
        assert after["hardware"] == ("H200-measured" if before["id"] in moved else before["hardware"])
    tp = load_scenario("long-context").model_dump(mode="json", exclude_none=True)
    assert with_hardware(tp, "H200-measured")[1] == []  # 4 tensor-parallel GPUs: not what was measured


def test_bench_refuses_a_named_scenario_without_a_worker_to_move(tmp_path):
    with pytest.raises(ScenarioError, match="no single-GPU H200 worker"):
        run_policy_bench(["chat-low-load"], tmp_path, jobs=1, presets=["static"], quick=True, plots=False,
                         hardware="H200-measured", console=Console(file=io.StringIO()))
    with pytest.raises(ValueError, match="choose one of"):
        run_policy_bench(["chat-low-load"], tmp_path, jobs=1, presets=["static"], quick=True, plots=False,
                         hardware="B200-measured", console=Console(file=io.StringIO()))


# -- the ceiling ------------------------------------------------------------------
# Sampling noise: a policy can draw luckier outcomes, and the oracle maximises each
# step's expected goodput, not the run's ratio of sums.
NOISE = 0.02


@pytest.mark.parametrize("hardware", ["H200-measured", "roofline"])
def test_the_oracle_is_the_ceiling_on_either_truth(tmp_path, hardware):
    report = run_policy_bench(out_dir=tmp_path, quick=True, jobs=1, plots=False, hardware=hardware,
                              scenario_data_override={"tiny-h200": h200_scenario(hardware="H200")},
                              console=Console(file=io.StringIO()))
    assert report["meta"]["hardware"] == hardware
    entry = report["scenarios"]["tiny-h200"]
    assert entry["hardware"] == {"w": "H200-measured" if hardware != "roofline" else "H200"}
    policies = entry["policies"]
    assert len(policies) >= 4 and "best_static" in policies and "oracle" in policies
    for name, p in policies.items():
        assert p["vs_oracle"] <= 1.0 + NOISE, (name, p["vs_oracle"])
    oracle = policies["oracle"]["goodput_tok_s"]
    for point in entry["grid"]:  # every static configuration, not only the best
        assert point["goodput_tok_s"] <= oracle * (1.0 + NOISE), point
    written = json.loads((tmp_path / "policies.json").read_text())
    assert written["meta"]["hardware"] == hardware
    assert written["scenarios"]["tiny-h200"]["hardware"] == entry["hardware"]


def tree_value(tree, conf: np.ndarray) -> float:
    """Σ over a tree's nodes of the product of confidences along the path (expected τ)."""
    value = np.zeros(tree.nodes + 1)
    value[0] = 1.0
    level = np.zeros(tree.nodes + 1, dtype=int)
    for i in range(tree.nodes + 1):  # breadth-first: a parent comes before its children
        first, count = int(tree.first_child[i]), int(tree.child_count[i])
        for rank in range(count):
            j = first + rank
            level[j] = level[i] + 1
            value[j] = value[i] * conf[level[i], rank]
    return float(value[1:].sum())


@pytest.mark.parametrize("hardware", ["H200-measured", "H200"])
def test_oracle_prices_static_allocations_as_the_simulator_charges_them(hardware):
    from bench.oracle import OracleDecider
    from worker.sim.tree import CONF_SCALE, chain_tree, quantize

    data = h200_scenario(duration_s=2.0, hardware=hardware)
    worker = SimWorker.fleet(scenario_from_dict(data))[0]
    run_simulated(worker, lambda rid, ctx, b: Decision(2, 2, 4), 0.3)
    oracle = OracleDecider(worker)
    running = worker.running
    b = len(running)
    ctx = np.array([r.prompt_len + r.generated for r in running], dtype=float)
    q = worker.acceptance.rank_probs_batch(ctx, np.ones(b), np.array([r.multiplier for r in running]))
    tokens, step_ms = oracle.static_prices(oracle.batch_lists(q), ctx, float(ctx.sum()))
    assert len(oracle.static_decisions) == len(tokens) > 4
    for s, d in enumerate(oracle.static_decisions):
        qconf = quantize(q)
        trees = [chain_tree(min(d.depth, d.max_nodes, q.shape[1])) if d.width == 1
                 else worker.trees.get(qconf[i], d.depth, d.width, d.max_nodes) for i in range(b)]
        nodes = np.array([t.nodes for t in trees])
        expected_ms = (worker.cost.verify_ms(b + nodes.sum(), ctx.sum(), ((1 + nodes) * ctx).sum(), batch=b)
                       + worker.cost.draft_ms([t.depth for t in trees], [t.width for t in trees], ctx))
        assert step_ms[s] == pytest.approx(expected_ms, rel=1e-9), d
        value = sum(tree_value(t, qconf[i] / CONF_SCALE) for i, t in enumerate(trees))
        assert tokens[s] == pytest.approx(b + value, rel=1e-9), d


def test_cli_passes_every_bench_hardware_choice(capsys):
    from bench.policies import hardware_choices
    from specctl.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["bench", "policies"]).hardware == "roofline"
    for choice in hardware_choices():
        assert parser.parse_args(["bench", "policies", "--quick", "--hardware", choice]).hardware == choice
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "policies", "--hardware", "B200-measured"])
