"""``specctl demo --real``: the controller driving a real worker.

One process holds: the controller (gRPC on a free loopback port, the chosen
policy preset), a reference worker (SmolLM2-135M, the chosen drafter — EAGLE
heads trained on first use and cached —, the engine thread, its agent
connected to the controller, the HTTP endpoint on a free loopback port) and
a load generator that goes through four phases:

1. chat prompts, concurrency 1
2. chat prompts, concurrency 8
3. code prompts, concurrency 8
4. code prompts, concurrency 1

A live table shows, per second, the phase, the batch the engine runs, the
plan version, the decision the agent applies now and what the plan says for
batch 1 / 4 / 8, acceptance (τ per row-step), step times and tokens/s. A
summary per phase follows.
"""

from __future__ import annotations

import random
import threading
import time

from policies.table import Decision

__all__ = ["run_real_demo"]

PHASES = [("chat", 1), ("chat", 8), ("code", 8), ("code", 1)]


def _fmt(d: Decision) -> str:
    if d.depth == 0:
        return "off"
    return f"d{d.depth}" + (f"w{d.width}/{d.max_nodes}" if d.width > 1 else "")


def run_real_demo(duration_s: float = 240.0, policy: str = "goodput", drafter: str = "eagle",
                  model: str = "smollm2-135m", max_new_tokens: int = 48, threads: int = 1) -> int:
    from rich.console import Console
    from rich.live import Live
    from rich.table import Table

    from controller.background import BackgroundController, in_process_config
    from worker.reference.threads import set_threads
    from worker.reference.load import LoadStats, run_phase
    from worker.reference.prompts import held_out, load_prompts
    from worker.reference.server import WorkerOptions, load_worker

    console = Console()
    set_threads(threads)
    duration_s = max(duration_s, 40.0)
    console.print(f"[bold]specctl demo --real[/]: controller (policy {policy}) + SmolLM2 worker ({drafter}) + load; "
                  f"{len(PHASES)} phases of {duration_s / len(PHASES):.0f} s")
    controller = BackgroundController(in_process_config(policy))
    opts = WorkerOptions(model=model, drafter=drafter, controller=controller.address, listen="127.0.0.1:0",
                         worker_id=f"ref-{drafter}", max_batch=8, fallback_depth=2)
    worker = load_worker(opts, log_fn=console.print).start()
    agent = worker.agent
    engine = worker.engine
    # prompts the heads never trained on (the 10% held out of `train-heads`)
    prompts = {d: held_out(load_prompts(d)) for d in ("chat", "code")}
    stats = LoadStats()
    phase_state = {"i": 0, "start": time.time()}
    summaries = []
    stop = threading.Event()

    def load_thread() -> None:
        rng = random.Random(0)
        for i, (domain, conc) in enumerate(PHASES):
            phase_state.update(i=i, start=time.time())
            t0 = time.time()
            run_phase(worker.address, prompts[domain], conc, duration_s / len(PHASES), 0.0, max_new_tokens, stats,
                      rng, stop)
            summaries.append((domain, conc, t0, time.time()))
        stop.set()

    last = {"t": time.time(), "tokens": 0, "rows": 0, "acc": 0, "steps": 0, "draft": 0.0, "verify": 0.0}
    decisions_seen: dict[int, set[str]] = {}

    def table() -> Table:
        s = engine.stats
        now = time.time()
        dt = max(now - last["t"], 1e-6)
        tps = (s.tokens - last["tokens"]) / dt
        rows = s.row_steps - last["rows"]
        tau = (s.accepted - last["acc"]) / rows if rows else 0.0
        steps = s.steps - last["steps"]
        draft_ms = 1e3 * (s.draft_s - last["draft"]) / steps if steps else 0.0
        verify_ms = 1e3 * (s.verify_s - last["verify"]) / steps if steps else 0.0
        last.update(t=now, tokens=s.tokens, rows=s.row_steps, acc=s.accepted, steps=s.steps, draft=s.draft_s,
                    verify=s.verify_s)
        batch = len(engine.rows)
        lim = engine.drafter.limits if engine.drafter is not None else None
        clamp = (lambda d: lim.clamp(d)) if lim else (lambda d: Decision.off())
        now_d = clamp(agent.decide("probe", 200, max(batch, 1)))
        i = phase_state["i"]
        decisions_seen.setdefault(i, set()).add(_fmt(now_d))
        t = Table(title=f"demo --real: {drafter} {worker.hello.drafter.version}, policy {policy}, "
                        f"{len(stats.results)} requests done")
        for col in ("phase", "load", "batch", "plan", "now", "b1/b4/b8", "τ", "draft/verify ms", "tok/s"):
            t.add_column(col, no_wrap=True)
        domain, conc = PHASES[i]
        per_batch = " / ".join(_fmt(clamp(agent.decide("probe", 200, b))) for b in (1, 4, 8))
        t.add_row(f"{i + 1} {now - phase_state['start']:3.0f}s", f"{domain}×{conc}", str(batch),
                  f"v{agent.plan_version}" + ("" if agent.stats.connected else "!"), _fmt(now_d), per_batch,
                  f"{tau:.2f}", f"{draft_ms:.0f}/{verify_ms:.0f}", f"{tps:.1f}")
        return t

    loader = threading.Thread(target=load_thread, daemon=True)
    loader.start()
    try:
        with Live(table(), console=console, refresh_per_second=1) as live:
            while not stop.wait(1.0):
                live.update(table())
    except KeyboardInterrupt:
        stop.set()
    finally:
        loader.join(timeout=120)
        worker.stop()
        controller.close()

    summary = Table(title="per phase")
    for col in ("phase", "load", "requests", "tok/s", "tokens/step", "decisions seen"):
        summary.add_column(col)
    for i, (domain, conc, t0, t1) in enumerate(summaries):
        s = stats.summary(since=t0, until=t1)
        summary.add_row(str(i + 1), f"{domain} ×{conc}", str(s["requests"]), f"{s['tokens_per_s'] or 0:.1f}",
                        f"{s['tokens_per_step'] or 0:.2f}", ", ".join(sorted(decisions_seen.get(i, ()))))
    console.print(summary)
    errors = [r for r in stats.results if not r.ok]
    if errors:
        console.print(f"[red]{len(errors)} failed requests; first: {errors[0].error}[/]")
    return 0 if not errors else 1
