"""``specctl bench catchup``: what a bounded EAGLE catch-up saves and costs.

EAGLE's head keeps its own KV cache over (target feature, next token) pairs.
A request that does not draft only queues its features; when it drafts again
(or drafts for the first time: the prompt) the head runs over everything
queued (``CatchUp``). ``catch_up_window`` W bounds that: only the newest W
queued pairs are run, the head attends to what it cached before, a gap, then
those (``EagleDrafter.set_catch_up_window``). It is lossless at any W (the
target verifies every draft); what it can cost is acceptance, since the head
drafts from a context with a hole in it, and what it saves is the head's
forward over the skipped pairs. The controller prices a switch-on as
``min(tokens skipped, W)`` tokens of catch-up (``Drafter.catch_up_window``
in the Hello).

The reference engine decodes held-out prompts (``bench.engine.eval_prompts``)
at one batch size with the EAGLE drafter at one static decision, once per
window (0 = unbounded, the reference), in three settings:

- ``start``: every request drafts from its first step, so each catches up
  on its prompt once;
- ``resume``: every request decodes plainly for its first ``off_steps``
  steps, then drafts: a switch-on after an off stretch, as under a
  controller that turned a batch off and on again;
- ``long``: ``resume`` on long prompts, each ``long_join`` held-out prompts
  joined into one, where an unbounded catch-up runs the head over hundreds
  of pairs.

Per setting and window: ``tau`` (accepted draft tokens per drafting
row-step), ``switch_ons`` (row-steps that caught up) with the tokens and
milliseconds caught up, and the CPU time of the decoding (``time.thread_time``,
torch on one intra-op thread in this thread) per generated token. The ratios
compare each window with the unbounded run of the same setting, in the same
process: ``tau_vs_unbounded`` (the acceptance it costs; deterministic, the
outputs are greedy), ``catch_up_ms_vs_unbounded`` and
``cpu_per_token_vs_unbounded`` (timed, so noisy on a shared machine: the
runs of a setting follow each other, the order rotating with the setting).
Every run is checked lossless against plain greedy decoding.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from policies.table import Decision
from worker.reference.threads import set_threads

__all__ = ["CatchUpRow", "DEFAULT_WINDOWS", "SETTINGS", "check_windows", "parse_windows", "run_catchup_bench"]

DEFAULT_WINDOWS = (0, 256, 64, 32, 16)
SETTINGS = ("start", "resume", "long")


@dataclass
class CatchUpRow:
    setting: str
    window: int  # 0 = unbounded
    prompts: int
    prompt_tokens_mean: float
    tau: float  # accepted draft tokens per drafting row-step
    drafting_row_steps: int
    switch_ons: int  # row-steps that caught up (the first draft after the prompt or an off stretch)
    caught_up_tokens_per_switch_on: float
    catch_up_ms: float  # all catch-ups of the run
    catch_up_ms_per_switch_on: float
    draft_ms_per_step: float
    verify_ms_per_step: float
    steps: int
    tokens: int
    cpu_s: float
    cpu_ms_per_token: float
    lossless: bool
    tau_vs_unbounded: float = 1.0
    catch_up_ms_vs_unbounded: float = 1.0
    cpu_per_token_vs_unbounded: float = 1.0


class _SwitchOns:
    """An engine observer counting the row-steps that caught up and the tokens they caught up on."""

    def __init__(self) -> None:
        self.switch_ons = 0
        self.tokens = 0

    def observe(self, step) -> None:
        for r in step.requests:
            if r.caught_up_tokens:
                self.switch_ons += 1
                self.tokens += r.caught_up_tokens

    def finish(self, summary) -> None:
        pass


def _off_then(decision: Decision, off_steps: int):
    """A decide callable: off for each request's first ``off_steps`` steps, then ``decision``."""
    steps: dict[str, int] = {}

    def decide(request_id: str, context_len: int, batch_size: int) -> Decision:
        steps[request_id] = steps.get(request_id, 0) + 1
        return decision if steps[request_id] > off_steps else Decision.off()

    return decide


def parse_windows(text: str) -> tuple[int, ...]:
    """``"0,64,16"`` -> ``(0, 64, 16)``; 0 (unbounded, the reference) must be among them.

    >>> parse_windows("0,64,16")
    (0, 64, 16)
    >>> parse_windows("64,16")
    Traceback (most recent call last):
    ...
    ValueError: windows must hold 0 (unbounded, the reference), each once, none negative; got (64, 16)
    """
    try:
        windows = tuple(int(w) for w in text.split(","))
    except ValueError:
        raise ValueError(f"expected comma-separated whole numbers of pairs, got {text!r}") from None
    return check_windows(windows)


def check_windows(windows) -> tuple[int, ...]:
    """``windows`` as a tuple of ints, if 0 (the unbounded reference) is among them, each once, none negative."""
    windows = tuple(int(w) for w in windows)
    if 0 not in windows or any(w < 0 for w in windows) or len(set(windows)) != len(windows):
        raise ValueError(f"windows must hold 0 (unbounded, the reference), each once, none negative; got {windows}")
    return windows


def _long_texts(texts: list[str], n: int, join: int) -> list[str]:
    """``n`` long prompts, each ``join`` consecutive texts of ``texts`` (cyclically) in one."""
    return ["\n\n".join(texts[(i * join + j) % len(texts)] for j in range(join)) for i in range(n)]


def run_catchup_bench(heads_dir: str, out_dir: str = "bench/results", model_name: str = "smollm2-135m",
                      windows=DEFAULT_WINDOWS, batch: int = 8, prompts: int = 16, long_prompts: int = 8,
                      long_join: int = 6, max_new_tokens: int = 32, off_steps: int = 12,
                      decision: Decision = Decision.chain(2), settings=SETTINGS, threads: int = 1,
                      kernels: str = "tuned", plot: bool = True) -> int:
    """The benchmark; see the module docstring. ``windows`` must hold 0 (the
    unbounded reference the ratios are taken against)."""
    from bench.engine import eval_prompts
    from worker.reference.engine.engine import Engine
    from worker.reference.models import load_model
    from worker.reference.prompts import chat_ids
    from worker.reference.server import build_drafter

    windows = check_windows(windows)
    unknown = set(settings) - set(SETTINGS)
    if unknown:
        raise ValueError(f"settings: unknown {sorted(unknown)}, expected some of {SETTINGS}")
    set_threads(threads)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lm = load_model(model_name, tune_kernels=kernels == "tuned")
    model, tok = lm.model, lm.tokenizer
    for p in model.parameters():
        p.requires_grad_(False)
    drafter = build_drafter("eagle", model, heads_dir, model_name, log_fn=lambda *_: None)
    items = eval_prompts(max(prompts, long_prompts * long_join))
    texts = [p.text for p in items]
    prompt_sets = {
        "start": ([chat_ids(tok, t) for t in texts[:prompts]], 0),
        "resume": ([chat_ids(tok, t) for t in texts[:prompts]], off_steps),
        "long": ([chat_ids(tok, t) for t in _long_texts(texts, long_prompts, long_join)], off_steps),
    }
    rows: list[CatchUpRow] = []
    started = time.time()
    with torch.inference_mode():
        for s, setting in enumerate(settings):
            ids, off = prompt_sets[setting]
            reference = Engine(model, max_batch=batch).generate(ids, max_new_tokens)
            order = windows[s % len(windows):] + windows[: s % len(windows)]  # the first run rotates
            done = {}
            for window in order:
                drafter.set_catch_up_window(window or None)
                seen = _SwitchOns()
                engine = Engine(model, drafter, _off_then(decision, off), observer=seen, max_batch=batch)
                cpu0 = time.thread_time()
                outputs = engine.generate(ids, max_new_tokens)
                cpu = time.thread_time() - cpu0
                st = engine.stats
                done[window] = CatchUpRow(
                    setting=setting, window=window, prompts=len(ids),
                    prompt_tokens_mean=round(sum(map(len, ids)) / len(ids), 1),
                    tau=round(st.accepted / max(st.spec_row_steps, 1), 4), drafting_row_steps=st.spec_row_steps,
                    switch_ons=seen.switch_ons,
                    caught_up_tokens_per_switch_on=round(seen.tokens / max(seen.switch_ons, 1), 1),
                    catch_up_ms=round(st.catch_up_s * 1e3, 2),
                    catch_up_ms_per_switch_on=round(st.catch_up_s * 1e3 / max(seen.switch_ons, 1), 3),
                    draft_ms_per_step=round(st.draft_s * 1e3 / max(st.steps, 1), 3),
                    verify_ms_per_step=round(st.verify_s * 1e3 / max(st.steps, 1), 3),
                    steps=st.steps, tokens=st.tokens, cpu_s=round(cpu, 3),
                    cpu_ms_per_token=round(cpu * 1e3 / max(st.tokens, 1), 3), lossless=outputs == reference)
                print(f"  {setting:7} window {window or 'all':>4}: tau {done[window].tau:.3f}, "
                      f"{seen.switch_ons} switch-ons, {done[window].catch_up_ms_per_switch_on:.2f} ms each", flush=True)
            base = done[0]
            for window in windows:
                row = done[window]
                row.tau_vs_unbounded = round(row.tau / base.tau, 4) if base.tau else 1.0
                row.catch_up_ms_vs_unbounded = round(row.catch_up_ms / base.catch_up_ms, 4) if base.catch_up_ms else 1.0
                row.cpu_per_token_vs_unbounded = round(row.cpu_ms_per_token / base.cpu_ms_per_token, 4)
                rows.append(row)
    result = {
        "model": model_name, "drafter": drafter.version, "batch": batch, "decision": str(decision),
        "max_new_tokens": max_new_tokens, "off_steps": off_steps, "long_join": long_join, "threads": threads,
        "kernels": kernels, "runtime_s": round(time.time() - started, 1), "rows": [asdict(r) for r in rows],
    }
    (out / "catchup.json").write_text(json.dumps(result, indent=1) + "\n")
    _print_table(rows)
    if plot:
        _plot(rows, out / "catchup.png", result)
    return 0 if all(r.lossless for r in rows) else 1


def _print_table(rows: list[CatchUpRow]) -> None:
    print(f"{'setting':8} {'window':>6} {'prompt':>6} {'tau':>6} {'vs all':>7} {'switch-ons':>10} "
          f"{'tok/on':>7} {'ms/on':>7} {'catch-up':>8} {'cpu/tok':>8} lossless")
    for r in rows:
        print(f"{r.setting:8} {r.window or 'all':>6} {r.prompt_tokens_mean:6.0f} {r.tau:6.3f} {r.tau_vs_unbounded:7.3f} "
              f"{r.switch_ons:10d} {r.caught_up_tokens_per_switch_on:7.1f} {r.catch_up_ms_per_switch_on:7.2f} "
              f"{r.catch_up_ms_vs_unbounded:8.3f} {r.cpu_per_token_vs_unbounded:8.3f} {r.lossless}")


def _plot(rows: list[CatchUpRow], path: Path, result: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 4.2))
    settings = list(dict.fromkeys(r.setting for r in rows))
    for setting in settings:
        mine = [r for r in rows if r.setting == setting]
        labels = [str(r.window or "all") for r in mine]
        axes[0].plot(labels, [r.tau_vs_unbounded for r in mine], marker="o", label=setting)
        axes[1].plot(labels, [r.catch_up_ms_per_switch_on for r in mine], marker="o", label=setting)
        axes[2].plot(labels, [r.cpu_per_token_vs_unbounded for r in mine], marker="o", label=setting)
    axes[0].set_title("acceptance (τ) vs unbounded")
    axes[1].set_title("catch-up ms per switch-on")
    axes[2].set_title("CPU per token vs unbounded (timed)")
    for ax in axes:
        ax.set_xlabel("catch-up window (pairs)")
        ax.grid(alpha=0.3)
        ax.legend()
    axes[0].axhline(1.0, color="grey", lw=0.8)
    axes[2].axhline(1.0, color="grey", lw=0.8)
    fig.suptitle(f"EAGLE catch-up window: {result['model']}, batch {result['batch']}, {result['decision']}, "
                 f"{result['drafter']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
