"""``specctl bench engine``: the reference engine on a real model, drafter by
drafter, static depths against the controller, at batch 1, 4 and 8.

Every run decodes the same held-out prompts (mixed chat / code / math /
summarisation, not used to train the heads) greedily to ``max_new_tokens``
through ``worker.engine.Engine`` with ``max_batch = batch``:

- ``none`` / ``plain``: no drafter (measured first and last at every batch;
  the mean is the baseline of ``speedup_vs_plain``; its outputs are the
  reference for ``lossless`` and the oracle's truth);
- ``hf-prompt-lookup`` / ``static-dK``: transformers
  ``generate(prompt_lookup_num_tokens=K)`` on the same model, one prompt at a
  time (transformers' assisted decoding is batch-1 only), batch 1 only;
- ``ngram`` / ``medusa`` / ``eagle`` at ``static-dK`` (chains) and under the
  controller (policy = a preset name): an in-process controller on loopback,
  one ``SpeculationAgent`` per drafter; the agent observes the drafter's
  static runs too, so the controller has fitted cost and acceptance models
  before its own runs;
- ``oracle`` / ``static-dK``: replays the target's own greedy continuation
  (100% acceptance), the ceiling of this verification pipeline here.

``tokens_per_s``: generated tokens / wall time of the run (prefill, drafting,
verification, Python overhead: everything). ``tokens_per_cpu_s``: the same
over the CPU time of the engine's thread (``time.thread_time``; torch runs
one intra-op thread, in that thread). On a machine shared with other
processes the wall clock swings by tens of percent from minute to minute
(plain greedy is measured twice per batch to show it), while CPU time only
counts the cycles the engine got, so ``speedup_vs_plain`` is computed on CPU
time and ``speedup_vs_plain_wall`` on wall time; both against the mean of the
two plain runs of the same batch. ``mean_accepted``: mean τ per row-step.
``lossless``: every output equals the plain run's token for token.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from policies.table import Decision

__all__ = ["EngineRun", "run_engine_bench"]


@dataclass
class EngineRun:
    drafter: str
    policy: str
    batch: int
    tokens_per_s: float
    speedup_vs_plain: float  # on engine-thread CPU time (see module docstring)
    mean_accepted: float
    lossless: bool
    tokens: int
    seconds: float
    tokens_per_cpu_s: float = 0.0
    speedup_vs_plain_wall: float = 0.0
    draft_ms_per_step: float = 0.0
    verify_ms_per_step: float = 0.0
    steps: int = 0
    note: str = ""


class _FanOut:
    """Observer that forwards telemetry to several agents (plain runs feed all)."""

    def __init__(self, observers):
        self.observers = [o for o in observers if o is not None]

    def observe(self, step):
        for o in self.observers:
            o.observe(step)

    def finish(self, summary):
        for o in self.observers:
            o.finish(summary)


def eval_prompts(n: int, held_out: float = 0.1):
    """``n`` held-out prompts of the shipped ``all`` set, domains interleaved
    (the same crc32 split as ``DistillSet.split``)."""
    from worker.prompts import held_out as held_out_prompts, load_prompts

    items = held_out_prompts(load_prompts("all"), held_out)
    by_domain: dict[str, list] = {}
    for p in items:
        by_domain.setdefault(p.domain, []).append(p)
    out = []
    while len(out) < n and any(by_domain.values()):
        for dom in sorted(by_domain):
            if by_domain[dom] and len(out) < n:
                out.append(by_domain[dom].pop(0))
    return out


class _Controller:
    """An in-process controller on a background event loop."""

    def __init__(self, policy: str) -> None:
        from controller.config import PlanSettings, ServerConfig, StoreSettings
        from controller.server import start_server

        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True, name="bench-controller").start()
        plan = PlanSettings(recompute_interval_s=0.5, min_push_interval_s=0.5)
        cfg = ServerConfig(listen="127.0.0.1:0", policy=policy, plan=plan, store=StoreSettings(path=""))
        self.running = asyncio.run_coroutine_threadsafe(start_server(cfg), self.loop).result(30)
        self.address = self.running.address

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.running.stop(0), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)


def run_engine_bench(out_dir: str = "bench/results", model_name: str = "smollm2-135m", batches=(1, 4, 8),
                     prompts: int = 8, max_new_tokens: int = 48, depths=(2, 4),
                     drafters=("ngram", "medusa", "eagle", "oracle"), policy: str = "goodput",
                     threads: int = 1, heads_dir: str | None = None, plot: bool = True) -> int:
    from tqdm.auto import tqdm

    from worker.cli import set_threads
    from worker.drafters.oracle import OracleDrafter
    from worker.engine.engine import Engine, static_decide
    from worker.models import load_model
    from worker.prompts import chat_ids
    from worker.server import build_drafter, make_hello

    set_threads(threads)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lm = load_model(model_name)
    model, tok = lm.model, lm.tokenizer
    for p in model.parameters():
        p.requires_grad_(False)
    items = eval_prompts(prompts)
    ids = [chat_ids(tok, p.text) for p in items]

    learned = [d for d in drafters if d in ("ngram", "medusa", "eagle")]
    built = {d: build_drafter(d, model, heads_dir, model_name) for d in learned}
    controller = _Controller(policy) if policy and learned else None
    agents = {}
    if controller is not None:
        from worker.agent import AgentOptions, SpeculationAgent

        for d in learned:
            hello = make_hello(f"bench-{d}", model_name, model, built[d], max(batches))
            agents[d] = SpeculationAgent(hello, controller.address, AgentOptions(fallback=Decision.chain(2))).start()

    n_runs = len(batches) * (2 + len(learned) * (len(depths) + (1 if controller else 0))
                             + (len(depths) if "oracle" in drafters else 0)) + len(depths)
    bar = tqdm(total=n_runs, desc="bench engine", unit="run")
    runs: list[EngineRun] = []
    plain_out: dict[int, list[list[int]]] = {}
    plain_tps: dict[int, list[float]] = {}
    plain_cpu: dict[int, list[float]] = {}

    def engine_run(drafter_name, drafter, decide, batch, policy_name, observer=None) -> EngineRun:
        engine = Engine(model, drafter, decide, observer=observer, max_batch=batch)
        t0, c0 = time.perf_counter(), time.thread_time()
        outs = engine.generate(ids, max_new_tokens)
        secs, cpu = time.perf_counter() - t0, time.thread_time() - c0
        s = engine.stats
        ref = plain_out.get(batch) or plain_out.get(1)
        run = EngineRun(drafter_name, policy_name, batch, tokens_per_s=s.tokens / secs, speedup_vs_plain=0.0,
                        mean_accepted=s.mean_accepted, lossless=ref is None or outs == ref, tokens=s.tokens,
                        seconds=secs, tokens_per_cpu_s=s.tokens / cpu,
                        draft_ms_per_step=1e3 * s.draft_s / max(s.steps, 1),
                        verify_ms_per_step=1e3 * s.verify_s / max(s.steps, 1), steps=s.steps)
        bar.set_postfix_str(f"{drafter_name} {policy_name} b{batch}: {run.tokens_per_s:.1f} tok/s")
        bar.update(1)
        return run, outs

    try:
        for batch in batches:
            run, outs = engine_run("none", None, None, batch, "plain", _FanOut(agents.values()))
            plain_out[batch] = outs
            plain_tps[batch] = [run.tokens_per_s]
            plain_cpu[batch] = [run.tokens_per_cpu_s]
            runs.append(run)
            if batch == batches[0]:
                for k in depths:  # the real peer: transformers' prompt lookup, batch 1
                    runs.append(_hf_prompt_lookup(model, ids, max_new_tokens, k, plain_out[batch]))
                    bar.update(1)
            for d in learned:
                for k in depths:
                    run, _ = engine_run(d, built[d], static_decide(Decision.chain(k)), batch, f"static-d{k}",
                                        agents.get(d))
                    runs.append(run)
                if d in agents:
                    agent = agents[d]
                    deadline = time.monotonic() + 20
                    while agent.plan_version < 1 and time.monotonic() < deadline:
                        time.sleep(0.2)
                    run, _ = engine_run(d, built[d], agent.decide, batch, policy, agent)
                    run.note = f"plan v{agent.plan_version}; decision at this batch: {agent.decide('probe', 200, batch)}"
                    runs.append(run)
            if "oracle" in drafters:
                truth = {tuple(p): o for p, o in zip(ids, plain_out[batches[0]])}
                for k in depths:
                    run, _ = engine_run("oracle", OracleDrafter(truth, max_depth=max(depths)),
                                        static_decide(Decision.chain(k)), batch, f"static-d{k}")
                    runs.append(run)
            run, _ = engine_run("none", None, None, batch, "plain")  # plain again: drift of the machine
            plain_tps[batch].append(run.tokens_per_s)
            plain_cpu[batch].append(run.tokens_per_cpu_s)
            run.policy = "plain-repeat"
            runs.append(run)
    finally:
        bar.close()
        import logging

        logging.getLogger("asyncio").setLevel(logging.CRITICAL)  # grpc.aio pollers of closed agent loops
        for a in agents.values():
            a.close()
        if controller is not None:
            controller.close()

    for r in runs:
        base = sum(plain_tps[r.batch]) / len(plain_tps[r.batch]) if r.batch in plain_tps else None
        base_cpu = sum(plain_cpu[r.batch]) / len(plain_cpu[r.batch]) if r.batch in plain_cpu else None
        r.speedup_vs_plain_wall = round(r.tokens_per_s / base, 3) if base else 0.0
        r.speedup_vs_plain = round(r.tokens_per_cpu_s / base_cpu, 3) if base_cpu else 0.0
        r.tokens_per_s = round(r.tokens_per_s, 2)
        r.tokens_per_cpu_s = round(r.tokens_per_cpu_s, 2)
        r.mean_accepted = round(r.mean_accepted, 3)
        r.seconds = round(r.seconds, 2)
        r.draft_ms_per_step = round(r.draft_ms_per_step, 2)
        r.verify_ms_per_step = round(r.verify_ms_per_step, 2)
    result = {
        "model": model_name,
        "prompts": [p.id for p in items],
        "max_new_tokens": max_new_tokens,
        "threads": torch.get_num_threads(),
        "policy": policy,
        "heads": {d: getattr(built[d], "version", "") for d in learned},
        "runs": [asdict(r) for r in runs],
    }
    (out / "engine.json").write_text(json.dumps(result, indent=1))
    if plot:
        _plot(runs, out / "engine.png", batches)
    _print_table(runs)
    print(f"wrote {out / 'engine.json'}" + (f" and {out / 'engine.png'}" if plot else ""))
    return 0


@torch.inference_mode()
def _hf_prompt_lookup(model, ids, max_new_tokens, k, reference) -> EngineRun:
    """transformers' prompt lookup, one prompt at a time. Its target
    forwards are counted with a forward hook, so its mean
    accepted length is comparable with the engine's: steps are
    deterministic under greedy decoding, unlike the clock."""
    outs, tokens, forwards = [], 0, [0]
    hook = model.register_forward_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    try:
        t0, c0 = time.perf_counter(), time.thread_time()
        for p in ids:
            x = torch.tensor([p])
            y = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                               max_new_tokens=max_new_tokens, prompt_lookup_num_tokens=k)
            o = y[0, len(p):].tolist()
            outs.append(o)
            tokens += len(o)
        secs, cpu = time.perf_counter() - t0, time.thread_time() - c0
    finally:
        hook.remove()
    # Assisted decoding runs the prompt and the first candidates in one
    # forward: every forward is one step, emitting τ + 1 tokens.
    steps = forwards[0]
    return EngineRun("hf-prompt-lookup", f"static-d{k}", 1, tokens_per_s=tokens / secs, speedup_vs_plain=0.0,
                     mean_accepted=(tokens - steps) / max(steps, 1), lossless=outs == reference,
                     tokens=tokens, seconds=secs, tokens_per_cpu_s=tokens / cpu, steps=steps,
                     note="transformers generate(prompt_lookup_num_tokens); batch 1 only")


def _print_table(runs) -> None:
    print(f"{'drafter':18} {'policy':14} {'batch':>5} {'tok/s':>7} {'tok/cpu-s':>9} {'speedup':>7} {'(wall)':>7} "
          f"{'τ':>5} {'lossless':>8}")
    for r in runs:
        print(f"{r.drafter:18} {r.policy:14} {r.batch:>5} {r.tokens_per_s:7.2f} {r.tokens_per_cpu_s:9.2f} "
              f"{r.speedup_vs_plain:7.3f} {r.speedup_vs_plain_wall:7.3f} {r.mean_accepted:5.2f} {str(r.lossless):>8}")


def _plot(runs, path: Path, batches) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(batches), figsize=(6 * len(batches), 5), sharey=True, squeeze=False)
    colors = {"none": "#888888", "hf-prompt-lookup": "#bb8844", "ngram": "#4477aa", "medusa": "#aa3377",
              "eagle": "#228833", "oracle": "#222222"}
    for ax, batch in zip(axes[0], batches):
        rs = [r for r in runs if r.batch == batch and r.policy != "plain-repeat"]
        labels = [f"{r.drafter}\n{r.policy}" for r in rs]
        ax.bar(range(len(rs)), [r.speedup_vs_plain for r in rs], color=[colors.get(r.drafter, "#999") for r in rs])
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.set_xticks(range(len(rs)))
        ax.set_xticklabels(labels, rotation=70, fontsize=7)
        ax.set_title(f"batch {batch}")
        for i, r in enumerate(rs):
            ax.text(i, r.speedup_vs_plain + 0.02, f"{r.tokens_per_s:.0f}", ha="center", fontsize=6)
    axes[0][0].set_ylabel("speedup vs plain greedy, same batch (engine CPU time)\nbar labels: tokens/s (wall)")
    fig.suptitle("specctl reference engine, SmolLM2-135M on this CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
