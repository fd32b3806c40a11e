"""``specctl bench llamacpp``: llama.cpp's prompt-lookup decoding, plain, static
and under the controller, on the shipped held-out prompt sets.

Per prompt set, side by side in one run (every prompt runs through every
configuration back to back, the order rotated from prompt to prompt, so a
noisy machine moves them all alike):

- ``plain``: llama.cpp without a draft model (``flash_attn`` on, as
  speculation needs for exact output; ``plain-no-flash`` is the same with it
  off, so the baseline is llama.cpp at its fastest either way);
- ``static-dN``: the binding's prompt lookup drafting at most N tokens, for
  every N in ``depths``; the best N >= 1 in hindsight is the goal's bar, and
  ``static-d0`` (the same path, never drafting) prices the draft-model path
  itself;
- ``lookup-default``: its default length (10, bigram match);
- ``controller``: the same lookup with the depth of every step from the plan
  of a ``specctl serve`` child process running the goodput preset: one worker
  per prompt set (a fleet whose workers serve different traffic);
- ``lookup-as-shipped``: the binding's own ``LlamaPromptLookupDecoding()``
  as its ``draft_model``, nothing of ours in the loop.

The static, default and controller rows run the same code path (the SDK
adapter, whose depth comes from a fixed decision or from the plan), so they
differ only in the depths drafted; ``lookup-as-shipped`` shows what the
adapter's prompt-logits trim is worth. Every configuration first sees the
same warm-up prompts (the set's prompts not held out, untimed); only the
controller learns from them. Output is checked token for token against
``plain``.
"""

from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from llama_cpp import Llama, __version__ as llama_cpp_version
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

from controller.client import fetch_status
from policies.presets import PRESET_DIR
from policies.table import Decision
from worker.reference.models import gguf_file
from worker.reference.prompts import held_out, load_prompts
from worker.sdk.agent import AgentOptions, SpeculationAgent
from worker.sdk.integrations.llamacpp import ControlledPromptLookup, calibrate, llamacpp_hello

PROMPT_SETS = ("chat", "code", "math", "summarise")
CONTROLLER = "controller"
AS_SHIPPED = "lookup-as-shipped"
DEFAULT_LENGTH = 10  # LlamaPromptLookupDecoding's num_pred_tokens


class FixedDepth:
    """A decider that always answers one chain depth (the static rows)."""

    def __init__(self, depth: int) -> None:
        self.decision = Decision.chain(depth)

    def decide(self, request_id: str, context_len: int, batch_size: int) -> Decision:
        return self.decision

    def observe(self, step) -> None:
        pass

    def finish(self, summary) -> None:
        pass


@dataclass
class RunResult:
    """One configuration on one prompt set (the ``runs`` rows of llamacpp.json)."""

    prompt_set: str
    policy: str
    tokens: int = 0
    seconds: float = 0.0
    steps: int = 0  # decode forwards (the prompt's excluded)
    drafted: int = 0
    accepted: int = 0
    lossless: bool = True
    mismatches: list[str] = field(default_factory=list)
    tokens_per_s: float = 0.0
    tau: float = 0.0  # accepted draft tokens per decode step
    speedup_vs_plain: float = 0.0

    def close(self, plain_tok_s: float) -> None:
        self.tokens_per_s = round(self.tokens / self.seconds, 2) if self.seconds else 0.0
        self.tau = round(self.accepted / self.steps, 3) if self.steps else 0.0
        self.speedup_vs_plain = round(self.tokens_per_s / plain_tok_s, 3) if plain_tok_s else 0.0


class CountingLookup(LlamaPromptLookupDecoding):
    """The binding's prompt lookup at a fixed length, counting steps and accepted
    tokens from what the engine kept between two calls (as the adapter does)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.steps = self.drafted = self.accepted = 0
        self._last: tuple[int, int] | None = None

    def new_request(self) -> None:
        self._last = None

    def __call__(self, input_ids, /, **kwargs):
        if self._last is not None:
            length, drafted = self._last
            self.steps += 1
            self.drafted += drafted
            self.accepted += len(input_ids) - length - 1
        draft = super().__call__(input_ids)
        self._last = (len(input_ids), len(draft))
        return draft


def prompt_ids(llm: Llama, text: str) -> list[int]:
    """One user turn in the GGUF's chat format (SmolLM2's ChatML), ready for the answer."""
    prompt = f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
    return llm.tokenize(prompt.encode(), add_bos=False, special=True)


def greedy(llm: Llama, ids: list[int], max_tokens: int) -> list[int]:
    """Greedy decoding from an empty cache: every configuration evaluates the whole
    prompt (the binding would otherwise reuse the KV of a previous identical prefix)."""
    llm.reset()
    eos = llm.token_eos()
    out: list[int] = []
    for tok in llm.generate(ids, temp=0.0, top_k=1, reset=True):
        if tok == eos or len(out) >= max_tokens:
            break
        out.append(tok)
    return out


class ServeProcess:
    """``specctl serve`` in a child process on a free loopback port: a policy file
    (re-read on :meth:`reload`, SIGHUP), a telemetry recording (:attr:`record`),
    optionally pinned to ``cpus``."""

    def __init__(self, workdir: Path, policy: Path, cpus: set[int] | None = None) -> None:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.target = f"127.0.0.1:{port}"
        self.policy = policy
        self.record = workdir / "telemetry.jsonl.gz"
        config = workdir / "controller.yaml"
        # Polling slowed to an hour: the policy changes only when reload() says so.
        config.write_text(f"listen: {self.target}\npolicy: {policy}\npolicy_poll_interval_s: 3600\n"
                          f"record: {self.record}\n")
        pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
        self.proc = subprocess.Popen([sys.executable, "-m", "specctl.cli", "serve", "--config", str(config)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, preexec_fn=pin,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + 60
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"specctl serve exited: {self.proc.stderr.read().decode()[-2000:]}")
            try:
                fetch_status(self.target, timeout=1.0)
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise RuntimeError("specctl serve did not answer within 60 s")
                time.sleep(0.2)

    def status(self):
        return fetch_status(self.target, timeout=5.0)

    def reload(self, policy_text: str) -> None:
        """Rewrite the policy file and have the controller read it (SIGHUP)."""
        self.policy.write_text(policy_text)
        self.proc.send_signal(signal.SIGHUP)

    def stop(self, kill: bool = False) -> None:
        if self.proc.poll() is None:
            if kill:  # kill -9: no goodbye to the workers
                self.proc.kill()
            else:
                self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def run_llamacpp_bench(out_dir: str = "bench/results", model: str = "smollm2-135m",
                       prompt_sets=PROMPT_SETS, prompts: int = 8, warmup_prompts: int = 4,
                       max_new_tokens: int = 96, depths=(0, 1, 2, 3, 4, 6, 8), threads: int = 1,
                       policy_file: str | None = None, plot: bool = True) -> int:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = str(gguf_file(model))
    kw = dict(model_path=path, n_ctx=2048, n_threads=threads, n_threads_batch=threads, verbose=False, seed=0)
    plain = Llama(flash_attn=True, **kw)
    plain_no_flash = Llama(flash_attn=False, **kw)
    shipped = CountingLookup()  # the binding's defaults: max_ngram_size=2, num_pred_tokens=10
    shipped_llm = Llama(flash_attn=True, logits_all=True, draft_model=shipped, **kw)
    max_depth = max(*depths, DEFAULT_LENGTH)
    static_draft = ControlledPromptLookup(FixedDepth(1), max_depth=max_depth, worker_tag="static")
    static_llm = Llama(flash_attn=True, logits_all=True, draft_model=static_draft, **kw)
    static_draft.attach(static_llm)
    statics = {f"static-d{k}": FixedDepth(k) for k in depths}
    statics["lookup-default"] = FixedDepth(DEFAULT_LENGTH)

    workdir = Path(tempfile.mkdtemp(prefix="specctl-bench-llamacpp-"))
    # The controller runs on its own machine in a fleet: here, on its own core(s), so its
    # planning does not take time from the engine's (the agent thread stays with the engine).
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    engine_cores, controller_cores = (set(cores[:threads]), set(cores[threads:])) if len(cores) > threads else (None, None)
    if engine_cores:
        os.sched_setaffinity(0, engine_cores)
    serve = ServeProcess(workdir, Path(policy_file) if policy_file else PRESET_DIR / "goodput.yaml", controller_cores)
    controlled: dict[str, tuple[Llama, ControlledPromptLookup, SpeculationAgent]] = {}
    results: dict[tuple[str, str], RunResult] = {}
    started = time.perf_counter()
    try:
        for name in prompt_sets:
            draft = ControlledPromptLookup(max_depth=max_depth, keep_records=True, worker_tag=name)
            llm = Llama(flash_attn=True, logits_all=True, draft_model=draft, **kw)
            hello = llamacpp_hello(llm, f"llamacpp-{name}", max_depth=max_depth,
                                   calibration=calibrate(llm, max_tokens=max_depth + 1, contexts=(64, 512)))
            agent = SpeculationAgent(hello, serve.target, AgentOptions(fallback=Decision.chain(2))).start()
            draft.attach(llm, agent)
            controlled[name] = (llm, draft, agent)

        policies = ["plain", "plain-no-flash", *statics, CONTROLLER, AS_SHIPPED]
        for s_i, name in enumerate(prompt_sets):
            items = load_prompts(name)
            test = held_out(items)[:prompts]
            warm = [p for p in items if p not in test][:warmup_prompts]
            llm_c, draft, agent = controlled[name]

            def run(policy: str, ids: list[int], rid: str) -> tuple[list[int], float, tuple[int, int, int]]:
                if policy in ("plain", "plain-no-flash"):
                    llm = plain if policy == "plain" else plain_no_flash
                    t0 = time.perf_counter()
                    toks = greedy(llm, ids, max_new_tokens)
                    return toks, time.perf_counter() - t0, (len(toks), 0, 0)
                if policy == AS_SHIPPED:
                    shipped.new_request()
                    before = (shipped.steps, shipped.drafted, shipped.accepted)
                    t0 = time.perf_counter()
                    toks = greedy(shipped_llm, ids, max_new_tokens)
                    dt = time.perf_counter() - t0
                    return toks, dt, (shipped.steps - before[0], shipped.drafted - before[1],
                                      shipped.accepted - before[2])
                adapter, llm = (draft, llm_c) if policy == CONTROLLER else (static_draft, static_llm)
                if policy != CONTROLLER:
                    adapter.agent = statics[policy]
                st = adapter.stats
                before = (st.steps, st.drafted_tokens, st.accepted_tokens)
                with adapter.request(rid, domain=name):
                    t0 = time.perf_counter()
                    toks = greedy(llm, ids, max_new_tokens)
                    dt = time.perf_counter() - t0
                return toks, dt, (st.steps - before[0], st.drafted_tokens - before[1], st.accepted_tokens - before[2])

            print(f"[{name}] warm-up: {len(warm)} prompts through all {len(policies)} configurations", flush=True)
            for w_i, p in enumerate(warm):
                ids = prompt_ids(plain, p.text)
                for policy in policies:
                    run(policy, ids, f"{name}-warm-{w_i}")
            for policy in policies:
                results[(name, policy)] = RunResult(name, policy)
            for p_i, p in enumerate(test):
                ids = prompt_ids(plain, p.text)
                order = policies[p_i % len(policies):] + policies[:p_i % len(policies)]
                outputs = {}
                for policy in order:
                    toks, dt, (steps, drafted, accepted) = run(policy, ids, f"{name}-{p.id}")
                    r = results[(name, policy)]
                    r.tokens += len(toks)
                    r.seconds += dt
                    r.steps += steps if policy not in ("plain", "plain-no-flash") else len(toks)
                    r.drafted += drafted
                    r.accepted += accepted
                    outputs[policy] = toks
                for policy in policies:
                    if policy != "plain-no-flash" and outputs[policy] != outputs["plain"]:
                        results[(name, policy)].lossless = False
                        results[(name, policy)].mismatches.append(p.id)
                elapsed = time.perf_counter() - started
                print(f"[{name}] {p_i + 1}/{len(test)} prompts, {elapsed:.0f} s elapsed", flush=True)
            base = results[(name, "plain")]
            base_tok_s = base.tokens / base.seconds
            for policy in policies:
                results[(name, policy)].close(base_tok_s)
        status = serve.status()
        plans = {w.hello.worker_id: [(c.depth, c.width) for c in w.plan.table][:4] for w in status.workers}
        agents = {n: asdict(a.stats) for n, (_, _, a) in controlled.items()}
        depth_use = {n: _depth_use(d) for n, (_, d, _) in controlled.items()}
    finally:
        import logging

        logging.getLogger("asyncio").setLevel(logging.CRITICAL)  # grpc.aio pollers of closed agent loops
        for _, _, agent in controlled.values():
            agent.close()
        serve.stop()

    runs = [asdict(r) for r in results.values()]
    summary = _summary(results, prompt_sets, statics)
    report = {
        "model": model,
        "gguf": Path(path).name,
        "engine": f"llama-cpp-python {llama_cpp_version}",
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "threads": threads, "engine_cores": sorted(engine_cores or []),
                    "controller_cores": sorted(controller_cores or [])},
        "max_new_tokens": max_new_tokens,
        "prompts_per_set": prompts,
        "warmup_prompts_per_set": warmup_prompts,
        "depths": list(depths),
        "runs": runs,
        "summary": summary,
        "controller": {"plans_first_cells": plans, "agents": agents, "requested_depths": depth_use},
        "seconds": round(time.perf_counter() - started, 1),
    }
    (out / "llamacpp.json").write_text(json.dumps(report, indent=1))
    _print(summary)
    if plot:
        _plot(results, summary, prompt_sets, out / "llamacpp.png")
    print(f"wrote {out / 'llamacpp.json'}" + (f" and {out / 'llamacpp.png'}" if plot else ""))
    return 0


def replot(json_path: str | Path) -> Path:
    """Redraw ``llamacpp.png`` beside a ``llamacpp.json``."""
    report = json.loads(Path(json_path).read_text())
    fields = set(RunResult.__dataclass_fields__)
    results = {(r["prompt_set"], r["policy"]): RunResult(**{k: v for k, v in r.items() if k in fields})
               for r in report["runs"]}
    sets = list(report["summary"])
    path = Path(json_path).with_suffix(".png")
    _plot(results, report["summary"], sets, path)
    return path


def _depth_use(draft: ControlledPromptLookup) -> dict[str, int]:
    """How often the controller asked for each depth in the timed and warm-up steps."""
    counts: dict[str, int] = {}
    for r in draft.records or []:
        counts[str(r.requested_depth)] = counts.get(str(r.requested_depth), 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: int(kv[0])))


def _summary(results, prompt_sets, statics) -> dict:
    out = {}
    for name in prompt_sets:
        # lengths >= 1: what "the best static draft length" means; static-d0 (the adapter, never
        # drafting) is reported beside it as the cost of the draft-model path itself
        static_rows = [results[(name, p)] for p in statics if p.startswith("static-d") and p != "static-d0"]
        best = max(static_rows, key=lambda r: r.tokens_per_s)
        ctl, plain = results[(name, CONTROLLER)], results[(name, "plain")]
        out[name] = {
            "best_static": best.policy,
            "best_static_tok_s": best.tokens_per_s,
            "controller_tok_s": ctl.tokens_per_s,
            "plain_tok_s": plain.tokens_per_s,
            "lookup_default_tok_s": results[(name, "lookup-default")].tokens_per_s,
            "lookup_as_shipped_tok_s": results[(name, AS_SHIPPED)].tokens_per_s,
            "controller_vs_best_static": round(ctl.tokens_per_s / best.tokens_per_s, 3),
            "controller_vs_plain": round(ctl.tokens_per_s / plain.tokens_per_s, 3),
            "best_static_vs_plain": round(best.tokens_per_s / plain.tokens_per_s, 3),
            "static_d0_tok_s": results[(name, "static-d0")].tokens_per_s if (name, "static-d0") in results else None,
            "all_lossless": all(r.lossless for (n, p), r in results.items() if n == name and p != "plain-no-flash"),
        }
    return out


def _print(summary: dict) -> None:
    print(f"{'set':<10} {'plain':>7} {'default':>8} {'best static':>16} {'controller':>10} {'vs best':>8} "
          f"{'vs plain':>8}  lossless")
    for name, s in summary.items():
        print(f"{name:<10} {s['plain_tok_s']:>7.1f} {s['lookup_default_tok_s']:>8.1f} "
              f"{s['best_static']:>9} {s['best_static_tok_s']:>6.1f} {s['controller_tok_s']:>10.1f} "
              f"{s['controller_vs_best_static']:>7.3f}x {s['controller_vs_plain']:>7.3f}x  {s['all_lossless']}")


def _plot(results, summary, prompt_sets, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = [p for (n, p) in results if n == prompt_sets[0]]
    colors = {"plain": "#7f7f7f", "plain-no-flash": "#c7c7c7", "lookup-default": "#1f77b4", CONTROLLER: "#d62728",
              AS_SHIPPED: "#9ecae1"}
    greens = iter(["#c7e9c0", "#a1d99b", "#74c476", "#41ab5d", "#238b45", "#006d2c", "#00441b"])
    for p in policies:
        colors.setdefault(p, next(greens, "#2ca02c"))
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.6))
    width = 0.8 / len(policies)
    x = np.arange(len(prompt_sets))
    for i, p in enumerate(policies):
        tok = [results[(n, p)].tokens_per_s for n in prompt_sets]
        tau = [results[(n, p)].tau for n in prompt_sets]
        axes[0].bar(x + i * width, tok, width, color=colors[p], label=p, edgecolor="black" if p == CONTROLLER else None)
        axes[1].bar(x + i * width, tau, width, color=colors[p], label=p, edgecolor="black" if p == CONTROLLER else None)
    for j, n in enumerate(prompt_sets):
        s = summary[n]
        axes[0].annotate(f"{s['controller_vs_best_static']:.2f}x best static\n{s['controller_vs_plain']:.2f}x plain",
                         (x[j] + 0.4, s["controller_tok_s"]), textcoords="offset points", xytext=(0, 8),
                         ha="center", fontsize=7)
    top = max(r.tokens_per_s for r in results.values())
    axes[0].set_ylim(0, top * 1.3)  # room for the notes above the controller's bars
    for ax, label in ((axes[0], "tokens / s (wall)"), (axes[1], "τ: accepted draft tokens per step")):
        ax.set_xticks(x + 0.4 - width / 2, prompt_sets)
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_title("llama.cpp (SmolLM2-135M Q4_1, CPU): prompt lookup, static vs under the controller",
                      fontsize=9, pad=4)
    axes[1].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
