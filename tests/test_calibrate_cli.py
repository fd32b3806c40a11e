"""``specctl calibrate``: one measured table that is both the worker's Hello.calibration and a
simulator hardware profile (worker.reference.engine.step_costs, worker.sim.measured)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from controller.config import ServerConfig
from controller.core.controller import Controller
from controller.protocol import MAX_CALIBRATION, validate_hello
from policies.presets import load_preset
from policies.table import Decision
from specctl.cli import main
from worker.reference.engine.step_costs import (StepGrid, calibration_samples, load_calibration, measure_step_table,
                                                 table_calibration)
from worker.reference.models import tiny_llama
from worker.reference.server import ReferenceWorker, WorkerOptions
from worker.sim.measured import MeasuredCostModel, load_table
from worker.sim.runner import run_simulated
from worker.sim.scenario import ScenarioError, scenario_from_dict
from worker.sim.worker import SimWorker

BATCHES, TOKENS, CONTEXTS, WIDTHS = (1, 2, 4), (1, 4, 8), (32, 128), (1, 2)
GRID = ["--batches", ",".join(map(str, BATCHES)), "--tokens", ",".join(map(str, TOKENS)),
        "--contexts", ",".join(map(str, CONTEXTS)), "--widths", ",".join(map(str, WIDTHS)), "--repeats", "5",
        "--kernels", "default", "--device", "cpu"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny seeded model saved as a checkpoint (a --model the worker loads) and its calibrated table."""
    root = tmp_path_factory.mktemp("calibrate")
    model, _ = tiny_llama(seed=0)
    model.save_pretrained(root / "tiny")
    out = root / "tiny-cpu.json"
    assert main(["calibrate", "--model", str(root / "tiny"), "--out", str(out), *GRID]) == 0
    return out, json.loads(out.read_text()), model


def test_the_cpu_path_writes_a_valid_table(tiny):
    _, table, model = tiny
    assert set(table) == {"info", "model", "verify", "draft"}
    assert table["model"]["layers"] == 2 and table["model"]["hidden"] == 64 and table["model"]["kv_heads"] == 2
    assert table["model"]["params"] == sum(p.numel() for p in model.parameters())
    assert table["info"]["device_type"] == "cpu" and table["info"]["repeats"] == 5
    assert "random weights" in table["info"]["draft"]  # no eagle heads for the tiny model
    verify = {(r["batch"], r["tokens_per_request"], r["context"]): r for r in table["verify"]}
    assert set(verify) == {(b, t, c) for b in BATCHES for t in TOKENS for c in CONTEXTS}
    for (b, t, c), r in verify.items():
        assert r["batch_tokens"] == b * t and r["kv_tokens"] == b * c
        assert r["verify_ms"] > 0
    # What the numbers are (a table of what the timer measured, per shape) is checked with a timer of known
    # costs below: measured on a shared machine, no relation between two shapes' wall times is safe to assert.
    draft = {(r["batch"], r["width"], r["context"]) for r in table["draft"]}
    assert draft == {(b, w, c) for b in BATCHES for w in WIDTHS for c in CONTEXTS}
    assert all(r["draft_level_ms"] > 0 for r in table["draft"])


class TokenTimer:
    """A timer that moves only by the work timed: ``ms_per_token`` for every token the model's input
    embedding looks up (the verify forward's ``batch x tokens`` block, the draft level's ``batch x width``
    ids), plus ``spike_ms`` once, on the ``spike_at``-th lookup (a slow moment of a shared machine)."""

    def __init__(self, model, ms_per_token: float, spike_at: int, spike_ms: float) -> None:
        self.now = 0.0
        self.calls = 0
        self.ms_per_token, self.spike_at, self.spike_ms = ms_per_token, spike_at, spike_ms
        self.hook = model.get_input_embeddings().register_forward_hook(self._charge)

    def _charge(self, module, args, output) -> None:
        self.calls += 1
        spike = self.spike_ms if self.calls == self.spike_at else 0.0
        self.now += (self.ms_per_token * args[0].numel() + spike) / 1e3

    def __call__(self) -> float:
        return self.now


def test_the_table_is_the_median_of_what_its_timer_measured_per_shape():
    """With a timer whose costs are known (0.1 ms a token) every row is known: verify ``0.1 x batch x
    tokens`` ms and draft ``0.1 x batch x width`` ms, whatever the context; so more tokens (a wider level)
    never cost less. A 50 ms stall on one timed call (the 5th lookup: the first cache's warm-up takes
    one call per token count, then the round-robin starts) does not move its shape's median."""
    model, _ = tiny_llama(seed=0)
    timer = TokenTimer(model, ms_per_token=0.1, spike_at=len(TOKENS) + 2, spike_ms=50.0)
    grid = StepGrid(BATCHES, TOKENS, CONTEXTS, WIDTHS, repeats=3)
    try:
        table = measure_step_table(model, grid, "tiny", log=lambda line: None, timer=timer)
    finally:
        timer.hook.remove()
    assert timer.calls > len(TOKENS) + 2  # the stall fell on a timed call
    verify = {(r["batch"], r["tokens_per_request"], r["context"]): r["verify_ms"] for r in table["verify"]}
    assert set(verify) == {(b, t, c) for b in BATCHES for t in TOKENS for c in CONTEXTS}
    for (b, t, c), ms in verify.items():
        assert ms == pytest.approx(0.1 * b * t, abs=1e-4), (b, t, c, ms)
    for b in BATCHES:
        for c in CONTEXTS:
            row = [verify[b, t, c] for t in TOKENS]
            assert row == sorted(row) and len(set(row)) == len(row), (b, c, row)
    draft = {(r["batch"], r["width"], r["context"]): r["draft_level_ms"] for r in table["draft"]}
    assert set(draft) == {(b, w, c) for b in BATCHES for w in WIDTHS for c in CONTEXTS}
    for (b, w, c), ms in draft.items():
        assert ms == pytest.approx(0.1 * b * w, abs=1e-4), (b, w, c, ms)
    assert table["info"]["repeats"] == 3 and table["info"]["device_type"] == "cpu"


def test_the_table_is_a_hello_calibration_the_controller_accepts(tiny):
    path, table, model = tiny
    worker = ReferenceWorker(model, None, None, "tiny", WorkerOptions(calibration=str(path), listen="127.0.0.1:0"))
    hello = worker.hello
    validate_hello(hello)
    assert len(hello.calibration) == len(table["verify"])
    rows = {(r["batch"], r["batch_tokens"], r["kv_tokens"]): r["verify_ms"] for r in table["verify"]}
    for c in hello.calibration:
        assert rows[c.batch_size, c.batch_tokens, c.kv_tokens] == pytest.approx(c.verify_ms)
        assert c.repeats == 5
    state = Controller(ServerConfig(), load_preset("goodput")).hello(hello)
    assert state.cost.calibration_samples == len(table["verify"])
    # The protobuf rows straight from the table are the same samples.
    assert list(calibration_samples(table)) == list(hello.calibration)


def test_a_large_table_sends_a_spread_subset_within_the_protos_limit(tiny):
    _, table, _ = tiny
    rows = [{"batch": b, "tokens_per_request": t, "context": c, "batch_tokens": b * t, "kv_tokens": b * c,
             "verify_ms": 1.0 + b * t * 0.01 + c * 1e-5}
            for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) for t in range(1, 17) for c in (1024, 4096, 16384)]
    big = {**table, "verify": rows, "info": {"repeats": 200}}
    picked = table_calibration(big)
    assert len(picked) == MAX_CALIBRATION < len(rows)
    assert {t.batch_size for t in picked} == {1, 2, 4, 8, 16, 32, 64, 128, 256}
    assert (picked[0].batch_tokens, picked[-1].batch_tokens) == (1, 256 * 16)  # both corners kept
    assert all(t.repeats == 64 for t in picked)  # the proto's range
    from protos.speculation.v1 import worker_pb2

    hello = worker_pb2.Hello(worker_id="w", drafter=worker_pb2.Drafter(kind=worker_pb2.DRAFTER_KIND_EAGLE, max_depth=4,
                                                                          max_width=1, max_tree_nodes=4),
                             calibration=calibration_samples(big))
    validate_hello(hello)


def test_another_models_table_is_refused_by_the_worker(tiny):
    path, _, _ = tiny
    other, _ = tiny_llama(seed=0, num_hidden_layers=3)
    with pytest.raises(ValueError, match="layers 2 \\(served: 3\\)"):
        load_calibration(path, other)
    with pytest.raises(ValueError, match="another model"):
        ReferenceWorker(other, None, None, "tiny3", WorkerOptions(calibration=str(path), listen="127.0.0.1:0"))


def scenario(table_path, **worker) -> dict:
    return {
        "name": "tiny-cpu-table",
        "duration_s": 1.0,
        "seed": 3,
        "traffic": {
            "arrivals": {"kind": "poisson", "rate": 300.0},
            "prompt_len": {"kind": "lognormal", "median": 60, "sigma": 0.3, "max": 120},
            "output_len": {"kind": "lognormal", "median": 24, "sigma": 0.3, "min": 4, "max": 64},
            "domain_mix": {"chat": 1.0},
        },
        "workers": [{"id": "cpu", "cost_table": str(table_path), "max_batch_size": 4, "noise_sigma": 0.0,
                     "drafter": {"kind": "eagle", "version": "t", "max_depth": 4, "max_width": 2, "max_nodes": 7},
                     **worker}],
    }


def test_the_table_prices_a_simulated_worker(tiny):
    path, table, _ = tiny
    spec = scenario_from_dict(scenario(path))
    worker = SimWorker.fleet(spec)[0]
    assert isinstance(worker.cost, MeasuredCostModel)
    assert worker.cost.model.n_layers == 2 and worker.hello.model == table["model"]["name"]
    for r in table["verify"]:  # every measured point comes back exactly
        assert worker.cost.verify_ms(r["batch_tokens"], r["kv_tokens"], batch=r["batch"]) == pytest.approx(
            r["verify_ms"], rel=1e-9)
    steps = []
    result = run_simulated(worker, lambda rid, ctx, b: Decision(3, 2, 6), spec.duration_s,
                           on_step=lambda s: steps.append(s))
    assert result.stats.tokens > 0
    t = [s for s in steps if not s.idle][-1].telemetry
    nodes = np.array([r.nodes for r in t.requests])
    ctx = np.array([r.context_len for r in t.requests], dtype=float)
    assert t.verify_ms == worker.cost.verify_ms(int(len(nodes) + nodes.sum()), float(ctx.sum()),
                                                 float(((1 + nodes) * ctx).sum()), batch=len(nodes))
    assert load_table(path).matches(worker.cost.model)


def test_a_scenario_refuses_a_model_of_other_shapes_and_a_missing_table(tiny, tmp_path):
    path, _, _ = tiny
    with pytest.raises(ScenarioError) as err:
        scenario_from_dict(scenario(path, model="llama-3-8b"))
    assert "cost_table" in str(err.value) and "'llama-3-8b'" in str(err.value)
    with pytest.raises(ScenarioError) as err:
        scenario_from_dict(scenario(tmp_path / "nowhere.json"))
    assert "workers.0.cost_table" in str(err.value) and "nowhere.json" in str(err.value)
    with pytest.raises(ScenarioError, match="cost_table: 2 GPUs"):
        scenario_from_dict(scenario(path, gpus=2))


def test_a_shape_on_random_weights_prints_progress(tmp_path, capsys):
    out = tmp_path / "shape.json"
    assert main(["calibrate", "--shape", "tiny", "--out", str(out), "--batches", "1,2", "--tokens", "1,2",
                 "--contexts", "16,32", "--widths", "1,2", "--repeats", "1", "--kernels", "default"]) == 0
    printed = capsys.readouterr().out
    assert "verify batch    2 context     32" in printed and "draft  batch" in printed and f"wrote {out}" in printed
    table = json.loads(out.read_text())
    assert table["model"]["name"] == "tiny" and table["info"]["source"].startswith("--shape tiny")


def test_llama_3_8b_shape_is_refused_on_the_cpu(tmp_path, capsys):
    out = tmp_path / "big.json"
    assert main(["calibrate", "--shape", "llama-3-8b", "--device", "cpu", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--shape llama-3-8b" in err and "GPU" in err and "--device cuda" in err and "--model smollm2-135m" in err
    assert not out.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this torch has CUDA")
def test_cuda_is_refused_cleanly_without_it(tmp_path, capsys):
    assert main(["calibrate", "--shape", "tiny", "--device", "cuda", "--out", str(tmp_path / "t.json")]) == 2
    assert "--device" in capsys.readouterr().err


@pytest.mark.parametrize("option, value, shown", [
    ("--batches", "1,x", "'x'"),
    ("--tokens", "0,2", "0"),
    ("--contexts", "128", "'128'"),
    ("--widths", "1,-2", "-2"),
    ("--repeats", "-1", "-1"),
])
def test_a_bad_grid_value_names_the_option_and_the_value(tmp_path, capsys, option, value, shown):
    args = ["calibrate", "--shape", "tiny", "--out", str(tmp_path / "t.json"), "--kernels", "default",
            "--batches", "1,2", "--tokens", "1,2", "--contexts", "16,32", "--widths", "1,2"]
    i = args.index(option) if option in args else len(args)
    args[i:i + 2] = [option, value]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"specctl calibrate: {option}: " in err and shown in err, err


def test_the_draft_level_times_trained_heads_when_given(tmp_path):
    from worker.reference.heads.modules import EagleHead
    from worker.reference.heads.store import HeadsBundle

    model, _ = tiny_llama(seed=0)
    bundle = HeadsBundle.build("eagle", EagleHead.config_from_target(model.config), torch.arange(40))
    bundle.save(tmp_path / "heads")
    out = tmp_path / "heads.json"
    assert main(["calibrate", "--shape", "tiny", "--heads", str(tmp_path / "heads"), "--out", str(out),
                 "--batches", "1,2", "--tokens", "1,2", "--contexts", "16,32", "--widths", "1,2", "--repeats", "1",
                 "--kernels", "default"]) == 0
    table = json.loads(out.read_text())
    assert table["info"]["draft"].startswith(f"trained eagle heads {bundle.version}")
    assert table["model"]["draft_vocab"] == 40


def test_compare_prices_the_new_table_against_another(tmp_path, capsys):
    """``--compare``: a table against a copy of itself with verify 2x slower on 4-token steps is off by
    2x exactly there, and its q/1 ratios by 2x; against the H200 table the models differ and it says so."""
    from worker.sim.measured import load_table
    from worker.sim.table_compare import compare_tables

    grid = ["--batches", "1,2", "--tokens", "1,4", "--contexts", "16,32", "--widths", "1,2", "--repeats", "1",
            "--kernels", "default"]
    first = tmp_path / "first.json"
    assert main(["calibrate", "--shape", "tiny", "--out", str(first), *grid]) == 0
    slower = json.loads(first.read_text())
    for row in slower["verify"]:
        row["verify_ms"] *= 2.0 if row["tokens_per_request"] == 4 else 1.0
    (tmp_path / "slower.json").write_text(json.dumps(slower))
    capsys.readouterr()

    c = compare_tables(load_table(tmp_path / "slower.json"), load_table(first))
    assert c.verify.points == 8 and c.verify.min == 1.0 and c.verify.max == 2.0
    assert c.q_over_1.points == 4 and c.q_over_1.median == 2.0 and c.draft.median == 1.0
    assert c.shapes_differ == [] and c.left_out == {"verify": 0, "draft": 0}

    out = tmp_path / "second.json"
    assert main(["calibrate", "--shape", "tiny", "--out", str(out), *grid, "--compare", "h200-llama3-8b.json"]) == 0
    printed = capsys.readouterr().out
    assert "against h200-llama3-8b.json" in printed and "different models" in printed
    written = json.loads((tmp_path / "second-vs-h200-llama3-8b.json").read_text())
    # The tiny grid (contexts 16, 32) lies below the H200 table's (1k..32k): every point is left out, none guessed.
    assert written["verify"]["points"] == 0 and written["left_out"]["verify"] == 8
    assert "no point inside the reference's grid" in printed


def test_compare_with_a_missing_table_fails_before_measuring(tmp_path, capsys):
    out = tmp_path / "never.json"
    assert main(["calibrate", "--shape", "tiny", "--out", str(out), "--compare", str(tmp_path / "nope.json")]) == 2
    err = capsys.readouterr().err
    assert "--compare" in err and "nope.json" in err
    assert not out.exists()


def test_the_command_line_runs_as_a_module_from_a_bare_checkout():
    """``python -m specctl`` (no installed entry point, as on a lent GPU machine): the same parser."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-m", "specctl", "calibrate", "--help"], cwd=root, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and "--compare" in done.stdout
