"""Row-count-aware linear kernels (``worker.reference.engine.kernels``): the dispatch
table's properties, the layer's numerics against ``F.linear``, the cache,
and greedy decoding through the engine on tuned layers against plain
``generate``."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from policies.table import Decision
from worker.reference.drafters.eagle import EagleDrafter
from worker.reference.drafters.oracle import OracleDrafter
from worker.reference.engine import kernels
from worker.reference.engine.engine import Engine, static_decide
from worker.reference.engine.kernels import (DENSE, INT8, Dispatch, ShapeTiming, StackTiming, TunedLinear, best_of,
                                   bf16_available, candidates, install, int8_available, mkl_only, plan_dispatch,
                                   time_stack, tune_model)
from worker.reference.heads.modules import EagleHead
from worker.reference.heads.store import HeadsBundle
from worker.reference.models import tiny_llama

pytestmark = pytest.mark.skipif(not kernels.kernels_available(), reason="torch built without oneDNN")


def forced(rows_max: int = 24, packed: str = "onednn:4") -> Dispatch:
    """A dispatch that uses every path: the packed kernel padded to a multiple of 4, MKL on every third row count."""
    choices = tuple((DENSE, r) if r % 3 == 0 else (packed, -(-r // 4) * 4) for r in range(1, rows_max + 1))
    return Dispatch(packed, choices, tuple(float(r) for r in range(1, rows_max + 1)))


def test_dispatch_pads_upwards_onto_the_grid_and_never_gets_cheaper_with_more_rows():
    rng = np.random.default_rng(3)
    rows = (1, 2, 3, 4, 6, 8, 12, 16)
    for _ in range(50):
        ms = {k: tuple(rng.uniform(1, 10, len(rows))) for k in (DENSE, "onednn:4", "onednn:16")}
        d = plan_dispatch(ShapeTiming(8, 4, 1, rows, ms))
        assert len(d.choices) == rows[-1]
        allowed = [DENSE] + ([d.packed] if d.packed is not None else [])
        for r, ((kernel, padded), cost) in enumerate(zip(d.choices, d.ms), start=1):
            assert kernel in allowed and padded >= r and padded in rows
            assert cost == ms[kernel][rows.index(padded)]
            # the cheapest measured way to run r rows among the kept kernels
            assert cost == min(ms[k][i] for k in allowed for i, g in enumerate(rows) if g >= r)
        assert all(a <= b for a, b in zip(d.ms, d.ms[1:]))


def test_dispatch_keeps_no_packed_copy_unless_it_pays():
    rows = (1, 2, 4)
    close = plan_dispatch(ShapeTiming(8, 4, 1, rows, {DENSE: (1.0, 2.0, 3.0), "onednn:4": (0.99, 1.99, 2.99)}))
    assert close.packed is None and {k for k, _ in close.choices} == {DENSE}
    better = plan_dispatch(ShapeTiming(8, 4, 1, rows, {DENSE: (1.0, 2.0, 3.0), "onednn:4": (0.5, 1.0, 1.5)}))
    assert better.packed == "onednn:4" and better.choices[0] == ("onednn:4", 1)


def test_tuned_layer_equals_f_linear_for_every_row_count_and_layout():
    torch.manual_seed(0)
    layer = torch.nn.Linear(37, 53)
    tuned = TunedLinear(layer, forced())
    with torch.inference_mode():
        for rows in range(1, 31):  # past the table's end too
            x = torch.randn(rows, 37)
            torch.testing.assert_close(tuned(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
        x = torch.randn(2, 5, 37)  # [batch, tokens, features], as a decoder layer calls it
        assert tuned(x).shape == (2, 5, 53)
        torch.testing.assert_close(tuned(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
        assert tuned(torch.randn(0, 37)).shape == (0, 53)
        strided = torch.randn(37, 7).t()  # not contiguous
        torch.testing.assert_close(tuned(strided), F.linear(strided, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)



def test_tuned_layer_runs_the_kernel_and_padding_its_dispatch_names(monkeypatch):
    calls = []
    packed_linear = kernels._packed_linear
    monkeypatch.setattr(kernels, "_packed_linear", lambda x, p, b: calls.append(x.shape[0]) or packed_linear(x, p, b))
    tuned = TunedLinear(torch.nn.Linear(16, 8), forced(rows_max=22))
    with torch.inference_mode():
        for rows in (1, 3, 5, 6, 30):
            tuned(torch.randn(rows, 16))
    assert calls == [4, 8, 30]  # 3 and 6 rows go to MKL; 30 is past the table: its last kernel, unpadded


@pytest.mark.skipif(not bf16_available(), reason="this CPU has no oneDNN bf16 kernels (AVX-512 BW/VL/DQ)")
def test_bf16_kernel_rounds_like_bfloat16_and_keeps_fp32_in_and_out():
    torch.manual_seed(2)
    layer = torch.nn.Linear(64, 40)
    tuned = TunedLinear(layer, forced(packed="bf16:16"))
    with torch.inference_mode():
        for rows in (1, 2, 5, 7, 30):
            x = torch.randn(rows, 64)
            y, exact = tuned(x), F.linear(x, layer.weight, layer.bias)
            assert y.dtype == torch.float32
            torch.testing.assert_close(y, exact, rtol=2e-2, atol=2e-2)  # bf16 inputs: ~3 significant digits
            bf16 = F.linear(x.bfloat16(), layer.weight.bfloat16()).float() + layer.bias
            if rows % 3:  # the rows the packed kernel runs (every third goes to MKL)
                torch.testing.assert_close(y, bf16, rtol=1e-2, atol=1e-2)
                assert not torch.equal(y, exact)


@pytest.mark.skipif(not int8_available(), reason="torch built without fbgemm's dynamic-quantised linear")
def test_int8_kernel_quantises_weights_per_row_and_keeps_fp32_in_and_out():
    torch.manual_seed(3)
    layer = torch.nn.Linear(96, 40)
    with torch.no_grad():
        layer.weight[7] *= 50  # one large row: per-row scales keep the others' precision
    tuned = TunedLinear(layer, forced(packed=INT8))
    scales = layer.weight.abs().amax(1, keepdim=True) / 127
    dequantised = (layer.weight / scales).round().clamp(-127, 127) * scales  # what fbgemm multiplies by
    with torch.inference_mode():
        for rows in (1, 2, 5, 7, 30):
            x = torch.randn(rows, 96)
            y, exact = tuned(x), F.linear(x, layer.weight, layer.bias)
            assert y.dtype == torch.float32 and y.shape == exact.shape
            if rows % 3 == 0:  # MKL's rows: exact
                torch.testing.assert_close(y, exact)
                continue
            assert not torch.equal(y, exact)
            rel = (y - exact).norm() / exact.norm()
            assert rel < 0.05, rel  # 7-bit activations, 8-bit weights
            # the weight rounding is per row: the error left is the activations' (one scale per call)
            on_dequantised = F.linear(x, dequantised, layer.bias)
            x_step = x.abs().max() / 63.5  # 7-bit activations spanning [min, max] of x
            bound = x_step * layer.weight.abs().sum(1)  # |Δx| ≤ one step on every input
            assert ((y - on_dequantised).abs() <= bound).all()


def test_lossy_kernels_are_candidates_only_where_allowed():
    exact = candidates((4, 16), allow_lossy=False)
    assert exact == [DENSE, "onednn:4", "onednn:16"]
    lossy = candidates((4, 16), allow_lossy=True)
    assert lossy[:3] == exact
    assert ({"bf16:4", "bf16:16"} <= set(lossy)) == bf16_available() and (INT8 in lossy) == int8_available()


def test_tuned_layer_falls_back_to_f_linear_under_autograd():
    torch.manual_seed(1)
    layer = torch.nn.Linear(16, 8)
    tuned = TunedLinear(layer, forced())
    x = torch.randn(5, 16, requires_grad=True)
    y = tuned(x)
    assert torch.equal(y, F.linear(x, layer.weight, layer.bias))
    y.sum().backward()
    assert x.grad is not None and layer.weight.grad is not None


def test_tune_model_times_installs_and_caches(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    torch.set_num_threads(1)
    model, _ = tiny_llama(seed=0)
    linears = sum(type(m) is torch.nn.Linear for m in model.modules())
    lines = []
    first = tune_model(model, reps=1, rows=(1, 2, 4, 8), show_progress=False, log=lines.append)
    assert not first.cached and first.path.is_file() and first.path.parent == tmp_path / "specctl" / "kernels"
    assert first.layers == linears and not any(type(m) is torch.nn.Linear for m in model.modules())
    assert set(first.dispatch) == {f"{o}x{i}" for o, i in ((64, 64), (32, 64), (128, 64), (64, 128))}
    for key, timing in first.timings.items():  # no lossy kernel for a target
        assert set(timing.ms) == {DENSE, "onednn:4", "onednn:16", "onednn:64"} and all(
            t > 0 for ms in timing.ms.values() for t in ms)
    assert "linear kernels:" in lines[0] and "whole stack vs MKL alone" in lines[0]
    # the tables were checked on the whole stack, and each layer runs what the report says
    assert first.stack.rows == (1, 2, 4, 8) and set(first.stack.total) == {"tables", "mix", "mkl"}
    assert all(ms > 0 for per in first.stack.total.values() for ms in per)
    for m in model.modules():
        if isinstance(m, TunedLinear):
            assert m.dispatch == first.dispatch[f"{m.out_features}x{m.in_features}"]
            assert (m._packed is None) == (m.dispatch.packed is None)
    again, _ = tiny_llama(seed=0)
    second = tune_model(again, reps=1, rows=(1, 2, 4, 8), show_progress=False, log=None)
    assert second.cached and second.dispatch == first.dispatch and second.path == first.path
    assert tune_model(again, reps=1, rows=(1, 2, 4, 8), show_progress=False, log=None) is None  # nothing left to tune
    first.path.write_text("{not json")  # a damaged cache is timed again, not trusted
    third, _ = tiny_llama(seed=0)
    assert not tune_model(third, reps=1, rows=(1, 2, 4, 8), show_progress=False, log=None).cached


def test_best_of_runs_the_option_cheapest_at_each_row_count():
    rng = np.random.default_rng(5)
    rows = (1, 2, 3, 4, 6, 8, 12, 16)
    for _ in range(50):
        timing = ShapeTiming(8, 4, 1, rows, {k: tuple(rng.uniform(1, 10, len(rows))) for k in (DENSE, "onednn:4")})
        table = plan_dispatch(timing)
        options = {"tables": table, "mkl": mkl_only(table, timing)}
        checked = rows[: rng.integers(1, len(rows) + 1)]
        costs = {n: tuple(rng.uniform(1, 10, len(checked))) for n in options}
        d = best_of(options, costs, checked, timing)
        for r in range(1, checked[-1] + 1):
            g = min(i for i, n in enumerate(checked) if n >= r)  # compared where they were timed in turns
            cheapest = min(options, key=lambda n: costs[n][g])
            assert d.choices[r - 1] == options[cheapest].lookup(checked[g])
        assert d.choices[checked[-1]:] == table.choices[checked[-1]:]  # past the checked rows: the tables
        runs_packed = any(k == table.packed for k, _ in d.choices)
        assert d.packed == (table.packed if runs_packed else None)


def test_the_stack_check_times_every_configuration_and_leaves_the_layers_as_they_were():
    torch.set_num_threads(1)
    model, _ = tiny_llama(seed=0)
    install(model, {"128x64": forced(), "64x128": forced(), "64x64": forced(), "32x64": forced()})
    layers = [m for m in model.modules() if isinstance(m, TunedLinear)]
    before = [m.dispatch for m in layers]
    mkl = {k: mkl_only(forced(), ShapeTiming(1, 1, 1, (1, 24), {DENSE: (1.0, 2.0)})) for k in ("128x64", "64x128",
                                                                                               "64x64", "32x64")}
    stack = time_stack(layers, (1, 3, 8), {"tables": {k: forced() for k in mkl}, "mkl": mkl}, reps=2)
    assert [m.dispatch for m in layers] == before
    assert stack.rows == (1, 3, 8) and set(stack.total) == {"tables", "mkl"}
    for name, total in stack.total.items():
        parts = stack.by_shape[name]
        assert set(parts) == set(mkl) and all(t > 0 for t in total)
        # each shape's least share may come from another repetition: together at most the least pass
        assert all(0 < sum(p[i] for p in parts.values()) <= total[i] + 1e-3 for i in range(3))


def test_tables_the_whole_stack_runs_slower_on_are_not_kept(tmp_path, monkeypatch):
    """Timed alone a packed kernel may win and still lose inside the model:
    the stack check decides, and a table it rejects keeps no packed copy."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    torch.set_num_threads(1)

    def mkl_wins(layers, rows, configs, reps=3, progress=None):
        cost = {"tables": 3.0, "mix": 2.0, "mkl": 1.0}
        shapes = {f"{m.out_features}x{m.in_features}" for m in layers}
        return StackTiming(tuple(rows), {n: tuple(cost[n] * r for r in rows) for n in configs},
                           {n: {s: tuple(cost[n] * r / len(shapes) for r in rows) for s in shapes} for n in configs})

    monkeypatch.setattr(kernels, "time_stack", mkl_wins)
    model, _ = tiny_llama(seed=0)
    report = tune_model(model, reps=1, rows=(1, 2, 4, 8), show_progress=False, log=None)
    on_grid = {1: 1, 2: 2, 3: 4, 4: 4, 5: 8, 6: 8, 7: 8, 8: 8}  # the row counts the stack was timed at
    for key, d in report.dispatch.items():
        assert d.packed is None and d.choices == tuple((DENSE, on_grid[r]) for r in range(1, 9)), key
    assert all(m._packed is None for m in model.modules() if isinstance(m, TunedLinear))
    cached, _ = tiny_llama(seed=0)  # the checked table is what the cache gives back
    again = tune_model(cached, reps=1, rows=(1, 2, 4, 8), show_progress=False, log=None)
    assert again.cached and again.dispatch == report.dispatch and again.stack == report.stack


def test_tied_output_embedding_stays_tied():
    model, _ = tiny_llama(seed=0, tie_word_embeddings=True)
    install(model, {"128x64": forced()})
    assert isinstance(model.lm_head, TunedLinear)
    assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.model
@pytest.mark.parametrize("decision", [Decision.chain(1), Decision.chain(5), Decision(4, 3, 10)])
@pytest.mark.parametrize("max_batch", [1, 3])
def test_greedy_decoding_on_tuned_layers_equals_plain_generate(decision, max_batch):
    torch.set_num_threads(1)
    model, vocab = tiny_llama(seed=0)
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (5, 12, 2, 9)]
    new = 16
    with torch.inference_mode():
        refs = [model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=new + 8)[0, len(p):].tolist()
                for p in prompts]
    install(model, {key: forced() for key in ("64x64", "32x64", "128x64", "64x128")})
    drafter = OracleDrafter({tuple(p): r for p, r in zip(prompts, refs)}, max_depth=6)
    engine = Engine(model, drafter, static_decide(decision), max_batch=max_batch)
    assert engine.generate(prompts, new) == [r[:new] for r in refs]
    assert engine.stats.mean_accepted > 0.5
    plain = Engine(model, max_batch=max_batch)
    assert plain.generate(prompts, new) == [r[:new] for r in refs]


@pytest.mark.model
@pytest.mark.parametrize("max_batch", [1, 3])
@pytest.mark.parametrize("lossy", ["bf16:4", INT8])
def test_a_drafter_on_lossy_kernels_leaves_greedy_decoding_lossless(tmp_path, monkeypatch, max_batch, lossy):
    """The drafter's layers may compute in bf16 or int8 (they only propose);
    the target verifies in fp32, so the output is ``generate``'s token for token."""
    if not (int8_available() if lossy == INT8 else bf16_available()):
        pytest.skip(f"no {lossy} kernels on this CPU / torch build")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    torch.set_num_threads(1)
    model, vocab = tiny_llama(seed=0)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (7, 3, 10)]
    new = 16
    with torch.inference_mode():
        refs = [model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=new)[0, len(p):].tolist()
                for p in prompts]
    vocab_map = torch.randperm(vocab, generator=torch.Generator().manual_seed(1))[:96].sort().values
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        bundle = HeadsBundle.build("eagle", EagleHead.config_from_target(model.config), vocab_map)
    drafter = EagleDrafter(bundle, model, max_depth=6, max_width=4, max_tree_nodes=32)
    layers = sum(type(m) is torch.nn.Linear for m in drafter.layers.modules())
    install(drafter.layers, {f"{m.out_features}x{m.in_features}": forced(packed=lossy)
                             for m in drafter.layers.modules() if type(m) is torch.nn.Linear})
    assert sum(isinstance(m, TunedLinear) for m in drafter.layers.modules()) == layers
    engine = Engine(model, drafter, static_decide(Decision(4, 2, 8)), max_batch=max_batch)
    assert engine.generate(prompts, new) == refs


@pytest.mark.model
def test_a_worker_tunes_its_drafter_on_the_draft_rows_with_lossy_kernels_offered(tmp_path, monkeypatch):
    """``build_drafter`` on a tuned target: the heads' layers are tuned too,
    on the rows a draft level runs, lossy kernels among the candidates (this
    path raised on CPUs without AVX-512 while bf16 was offered everywhere)."""
    from worker.reference.server import build_drafter

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    torch.set_num_threads(1)
    model, vocab = tiny_llama(seed=0)
    tune_model(model, reps=1, rows=(1, 2, 4, 8), show_progress=False, log=None)
    vocab_map = torch.arange(0, vocab, 2)
    HeadsBundle.build("eagle", EagleHead.config_from_target(model.config), vocab_map).save(tmp_path / "heads")
    drafter = build_drafter("eagle", model, str(tmp_path / "heads"), "tiny", log_fn=lambda *_: None)
    tuned = [m for m in drafter.layers.modules() if isinstance(m, TunedLinear)]
    assert tuned and not any(type(m) is torch.nn.Linear for m in drafter.layers.modules())
    assert all(len(m.dispatch.choices) == kernels.DRAFT_ROW_GRID[-1] for m in tuned)
    tables = [json.loads(f.read_text())["timings"] for f in (tmp_path / "specctl" / "kernels").glob("*.json")]
    assert len(tables) == 2  # the target's and the drafter's
    lossy = {k for timed in tables for t in timed.values() for k in t["ms"]} - {DENSE, "onednn:4", "onednn:16",
                                                                                "onednn:64"}
    assert lossy == set(candidates(kernels.PACK_HINTS, allow_lossy=True)) - set(candidates(kernels.PACK_HINTS, False))
