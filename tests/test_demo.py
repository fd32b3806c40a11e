"""`specctl demo` end to end on a tiny scenario: controller, agents and
simulated workers over real gRPC, baselines in a subprocess, JSON + PNG."""

import json
from pathlib import Path

from specctl.demo import run_demo

TINY = """
name: tiny
duration_s: 12
seed: 3
traffic:
  arrivals: {kind: poisson, rate: 3.0}
  prompt_len: {kind: lognormal, median: 400, sigma: 0.5, max: 4000}
  output_len: {kind: lognormal, median: 64, sigma: 0.4, min: 8, max: 256}
  domain_mix: {chat: 1.0}
workers:
  - id: h100-eagle
    hardware: H100-SXM
    drafter: {kind: eagle, version: v1, max_depth: 6, max_width: 4, max_nodes: 24, trained_context_len: 8192}
    max_batch_size: 64
"""


def test_demo_runs_the_loop_and_writes_results(tmp_path: Path) -> None:
    scenario = tmp_path / "tiny.yaml"
    scenario.write_text(TINY)
    assert run_demo(duration_s=3.0, scenario=str(scenario), policy="goodput", out_dir=str(tmp_path / "out")) == 0
    result = json.loads((tmp_path / "out" / "demo.json").read_text())
    assert (tmp_path / "out" / "demo.png").stat().st_size > 0
    workers = result["workers"]
    assert set(workers) == {"controller", "always on", "always off"}
    controlled = workers["controller"]["h100-eagle"]
    assert controlled["steps"] > 0 and controlled["tokens"] > 0
    # The controller's plans reached the worker: it speculated on some steps.
    assert controlled["speculation_fraction"] > 0
    assert workers["always off"]["h100-eagle"]["speculation_fraction"] == 0
    assert result["fleet_goodput_tok_s"]["controller"] > 0
