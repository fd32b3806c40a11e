"""``specctl bench typical``: what typical acceptance buys and costs on SmolLM2.

The reference engine decodes the same held-out prompts (``bench.engine.eval_prompts``:
chat, code, math and summarisation interleaved) greedily, one request at a
time (batch 1), with one drafter (n-gram prompt lookup: no trained heads
needed, so the numbers do not depend on a training run) at one static
decision, under:

- ``plain``: no drafter, the target's greedy output: the reference;
- ``strict``: the lossless rule (output = ``plain``'s, token for token);
- ``typical eps=E``: Medusa-2's typical acceptance at each ``E`` of
  ``epsilons`` with ``delta = sqrt(E)`` (Medusa's pairing; its default is
  ``E = 0.09, delta = 0.3``): a drafted token passes when its target
  probability (temperature-1 softmax: the requests are greedy) exceeds
  ``min(E, delta * exp(-H))``.

Timing is interleaved per prompt: each prompt is decoded by every
configuration in turn (the first one rotating from prompt to prompt), each
configuration on an engine of its own, so a slow minute of the shared
machine falls on all of them alike. ``tokens_per_cpu_s`` counts the CPU time
of the decoding thread (torch runs one intra-op thread, in it) and is what
the speedups are computed on; ``tokens_per_s`` is the wall clock's.

Quality, each against the ``plain`` output of the same prompt:

- ``agreement``: share of positions ``i`` (up to the longer of the two
  outputs) where the two hold the same token; after the first divergence
  the texts shift, so this mostly measures the common prefix plus chance;
- ``common_prefix`` (mean tokens) and ``common_prefix_share`` (their sum
  over the reference's tokens);
- ``loglik_per_100``: the target's own log-likelihood (nats, temperature-1
  softmax, teacher-forced over prompt + output) of the emitted tokens, per
  100 tokens; ``loglik_per_100_vs_greedy`` is that minus the greedy
  output's over the same prompts (negative: the target finds the relaxed
  text less likely than its own greedy text). Texts differ in how
  predictable they are (a summary copied from its source scores high), so
  this compares outputs, not decisions;
- ``logp_gap_per_100``: the decisions' own cost, per 100 tokens: the sum
  over emitted tokens of ``log p(x) - log p(argmax)`` at that position
  (0 for greedy output, up to the rounding between the decoding passes and
  this one; every accepted non-argmax draft makes it more negative).

``tau``: accepted draft tokens per step (a step emits ``tau + 1``).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from policies.table import Decision
from worker.reference.threads import set_threads

__all__ = ["DEFAULT_EPSILONS", "TypicalRow", "agreement", "common_prefix", "run_typical_bench"]

DEFAULT_EPSILONS = (0.3, 0.09, 0.03)
DEFAULT_DECISION = Decision(4, 2, 6)  # n-gram tree: depth 4, two candidates per level, 6 nodes
QUICK = {"prompts": 2, "max_new_tokens": 12, "epsilons": (0.09,)}


@dataclass
class TypicalRow:
    """One configuration's totals over every prompt."""

    rule: str
    epsilon: float | None
    delta: float | None
    tau: float = 0.0
    tokens_per_s: float = 0.0
    tokens_per_cpu_s: float = 0.0
    speedup_vs_plain: float = 0.0  # CPU time
    speedup_vs_strict: float = 0.0  # CPU time
    agreement: float = 0.0
    common_prefix: float = 0.0
    common_prefix_share: float = 0.0
    loglik_per_100: float = 0.0
    loglik_per_100_vs_greedy: float = 0.0
    logp_gap_per_100: float = 0.0
    tokens: int = 0
    steps: int = 0
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    outputs: list[list[int]] = field(default_factory=list, repr=False)


def common_prefix(a: list[int], b: list[int]) -> int:
    """Tokens the two sequences share from the start.

    >>> common_prefix([1, 2, 3], [1, 2, 4, 5])
    2
    """
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def agreement(out: list[int], ref: list[int]) -> tuple[int, int]:
    """(positions holding the same token, positions compared = the longer length).

    >>> agreement([1, 2, 3], [1, 5, 3, 4])
    (2, 4)
    """
    return sum(x == y for x, y in zip(out, ref)), max(len(out), len(ref))


@torch.inference_mode()
def _loglik(model, prompt: list[int], output: list[int]) -> tuple[float, float]:
    """The target's log-likelihood (nats) of ``output`` after ``prompt``,
    teacher-forced, and its gap to the argmax's: ``(Σ log p(x), Σ log p(x) -
    max log p)`` over the output's positions."""
    if not output:
        return 0.0, 0.0
    ids = torch.tensor([prompt + output], device=next(model.parameters()).device)
    logits = model(ids).logits[0, len(prompt) - 1 : -1].float()  # [len(output), vocab]: each predicts the next
    logp = torch.log_softmax(logits, -1)
    chosen = logp.gather(-1, ids[0, len(prompt):, None]).squeeze(-1)  # [len(output)]
    return float(chosen.sum()), float((chosen - logp.max(-1).values).sum())


def _configs(epsilons) -> list[tuple[str, object]]:
    """``(label, rule)``; ``None`` = plain decoding (no drafter)."""
    from worker.reference.engine.verify import STRICT, AcceptanceRule

    out: list[tuple[str, object]] = [("plain", None), ("strict", STRICT)]
    out += [(f"typical eps={e:g}", AcceptanceRule.make_typical(e)) for e in epsilons]
    return out


def run_typical_bench(out_dir: str = "bench/results", model_name: str = "smollm2-135m", prompts: int = 8,
                      max_new_tokens: int = 48, epsilons=DEFAULT_EPSILONS, decision: Decision = DEFAULT_DECISION,
                      threads: int = 1, kernels: str = "tuned", quick: bool = False, plot: bool = True) -> int:
    """The benchmark; see the module docstring. ``quick``: 2 prompts, 12
    tokens, one epsilon (tests)."""
    from bench.engine import eval_prompts
    from worker.reference.drafters.ngram import NgramDrafter
    from worker.reference.engine.engine import Engine, EngineStats, static_decide
    from worker.reference.models import load_model
    from worker.reference.progress import ProgressBar
    from worker.reference.prompts import chat_ids

    if quick:
        prompts, max_new_tokens, epsilons = QUICK["prompts"], QUICK["max_new_tokens"], QUICK["epsilons"]
    set_threads(threads)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    items = eval_prompts(prompts)
    lm = load_model(model_name, tune_kernels=kernels == "tuned", log=None)
    model, tok = lm.model, lm.tokenizer
    ids = [chat_ids(tok, p.text) for p in items]
    configs = _configs(epsilons)
    limits = NgramDrafter().limits
    decision = decision.clamp(limits.max_depth, limits.max_width, limits.max_tree_nodes)
    engines = {label: Engine(model, NgramDrafter() if rule is not None else None,
                             static_decide(decision) if rule is not None else None, max_batch=1, acceptance=rule)
               for label, rule in configs}
    # Untimed warm-up (first forwards allocate; the kernels' first calls pick their paths).
    for engine in engines.values():
        engine.generate([ids[0][-32:]], 4)
        engine.stats = EngineStats()
    print(f"bench typical: {model_name}, n-gram drafter at {decision}, {len(ids)} prompts x {max_new_tokens} "
          f"tokens, greedy, configurations: {', '.join(label for label, _ in configs)}", flush=True)

    outputs: dict[str, list[list[int]]] = {label: [] for label, _ in configs}
    secs = {label: 0.0 for label, _ in configs}
    cpu = {label: 0.0 for label, _ in configs}
    bar = ProgressBar(len(ids) * len(configs), "bench typical (prompt x configuration, interleaved)")
    try:
        for i, prompt in enumerate(ids):
            shift = i % len(configs)
            for label, _ in configs[shift:] + configs[:shift]:
                t0, c0 = time.perf_counter(), time.thread_time()
                outputs[label].append(engines[label].generate([prompt], max_new_tokens)[0])
                secs[label] += time.perf_counter() - t0
                cpu[label] += time.thread_time() - c0
                bar.update(1)
    finally:
        bar.close()

    reference = outputs["plain"]
    cache: dict[tuple[int, tuple[int, ...]], tuple[float, float]] = {}  # identical outputs score identically

    def loglik(i: int, output: list[int]) -> tuple[float, float]:
        key = (i, tuple(output))
        if key not in cache:
            cache[key] = _loglik(model, ids[i], output)
        return cache[key]

    greedy_ll = sum(loglik(i, o)[0] for i, o in enumerate(reference))
    greedy_tokens = sum(len(o) for o in reference)
    rows = []
    for label, rule in configs:
        st = engines[label].stats
        outs = outputs[label]
        same = [agreement(o, r) for o, r in zip(outs, reference)]
        prefixes = [common_prefix(o, r) for o, r in zip(outs, reference)]
        tokens = sum(len(o) for o in outs)
        ll = sum(loglik(i, o)[0] for i, o in enumerate(outs))
        gap = sum(loglik(i, o)[1] for i, o in enumerate(outs))
        rows.append(TypicalRow(
            rule=label, epsilon=rule.epsilon if rule is not None and rule.typical else None,
            delta=rule.delta if rule is not None and rule.typical else None,
            tau=round(st.accepted / max(st.row_steps, 1), 3),
            tokens_per_s=round(tokens / secs[label], 2), tokens_per_cpu_s=round(tokens / cpu[label], 2),
            agreement=round(sum(s for s, _ in same) / max(sum(n for _, n in same), 1), 4),
            common_prefix=round(sum(prefixes) / len(prefixes), 2),
            common_prefix_share=round(sum(prefixes) / max(greedy_tokens, 1), 4),
            loglik_per_100=round(100 * ll / max(tokens, 1), 2),
            loglik_per_100_vs_greedy=round(100 * ll / max(tokens, 1) - 100 * greedy_ll / max(greedy_tokens, 1), 2),
            logp_gap_per_100=round(100 * gap / max(tokens, 1), 2),
            tokens=tokens, steps=st.steps, seconds=round(secs[label], 2), cpu_seconds=round(cpu[label], 2),
            outputs=outs))
    by = {r.rule: r for r in rows}
    for r in rows:
        r.speedup_vs_plain = round(r.tokens_per_cpu_s / by["plain"].tokens_per_cpu_s, 3)
        r.speedup_vs_strict = round(r.tokens_per_cpu_s / by["strict"].tokens_per_cpu_s, 3)
    if by["strict"].outputs != reference:
        raise AssertionError("strict acceptance changed the greedy output: the engine is not lossless")

    result = {
        "model": model_name,
        "drafter": "ngram (prompt lookup)",
        "decision": {"depth": decision.depth, "width": decision.width, "max_nodes": decision.max_nodes},
        "prompts": [p.id for p in items],
        "max_new_tokens": max_new_tokens,
        "batch": 1,
        "greedy": True,
        "threads": torch.get_num_threads(),
        "kernels": kernels,
        "delta_rule": "delta = sqrt(epsilon) (Medusa)",
        "timing": "interleaved per prompt, first configuration rotating; speedups on decoding-thread CPU time",
        "seconds_total": round(time.perf_counter() - t_start, 1),
        "rows": [{k: v for k, v in asdict(r).items() if k != "outputs"} for r in rows],
        "outputs": {r.rule: r.outputs for r in rows},
    }
    (out / "typical.json").write_text(json.dumps(result, indent=1))
    if plot:
        _plot(rows, out / "typical.png", result)
    _print_table(rows)
    print(f"wrote {out / 'typical.json'}" + (f" and {out / 'typical.png'}" if plot else "")
          + f" ({result['seconds_total']:.0f} s)")
    return 0


def _print_table(rows) -> None:
    print(f"{'rule':18} {'tau':>5} {'tok/s':>7} {'tok/cpu-s':>9} {'vs strict':>9} {'agree':>6} {'prefix':>7} "
          f"{'ll/100':>8} {'Δll/100':>8} {'gap/100':>8}")
    for r in rows:
        print(f"{r.rule:18} {r.tau:5.2f} {r.tokens_per_s:7.2f} {r.tokens_per_cpu_s:9.2f} {r.speedup_vs_strict:9.3f} "
              f"{r.agreement:6.3f} {r.common_prefix_share:7.3f} {r.loglik_per_100:8.1f} "
              f"{r.loglik_per_100_vs_greedy:8.1f} {r.logp_gap_per_100:8.2f}")


def _plot(rows, path: Path, result: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r.rule.replace("typical ", "typical\n") for r in rows]
    x = range(len(rows))
    colors = ["#888888", "#4477aa"] + ["#cc6677"] * (len(rows) - 2)
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.2))
    ax = axes[0]
    ax.bar(x, [r.tau for r in rows], color=colors, edgecolor="k", linewidth=0.4)
    ax.set_title("accepted draft tokens per step (τ)", fontsize=9)
    ax2 = axes[1]
    ax2.bar(x, [r.speedup_vs_plain for r in rows], color=colors, edgecolor="k", linewidth=0.4)
    ax2.axhline(1.0, color="k", lw=0.8, ls="--")
    for i, r in enumerate(rows):
        ax2.text(i, r.speedup_vs_plain + 0.01, f"{r.tokens_per_s:.1f} tok/s", ha="center", fontsize=7)
    ax2.set_title("speedup vs plain greedy (CPU time); wall tok/s", fontsize=9)
    ax3 = axes[2]
    ax3.bar([i - 0.2 for i in x], [r.agreement for r in rows], 0.4, color="#228833", label="agreement")
    ax3.bar([i + 0.2 for i in x], [r.common_prefix_share for r in rows], 0.4, color="#ccbb44",
            label="common prefix share")
    ax3.set_ylim(0, 1.05)
    ax3.set_title("quality vs the target's greedy output", fontsize=9)
    ax4 = ax3.twinx()
    ax4.plot(list(x), [r.loglik_per_100_vs_greedy for r in rows], "ko-", ms=4, label="Δ log-lik / 100 tok vs greedy")
    ax4.plot(list(x), [r.logp_gap_per_100 for r in rows], "ks--", ms=4, mfc="w",
             label="log p(x) - log p(argmax), / 100 tok")
    ax4.axhline(0.0, color="k", lw=0.5)
    ax4.set_ylabel("nats per 100 tokens (target's log-likelihood)", fontsize=8)
    lines = ax3.get_legend_handles_labels()
    more = ax4.get_legend_handles_labels()
    ax3.legend(lines[0] + more[0], lines[1] + more[1], fontsize=7, loc="lower left")
    for a in axes:
        a.set_xticks(list(x))
        a.set_xticklabels(labels, fontsize=7)
    d = result["decision"]
    shape = f"d{d['depth']}w{d['width']}n{d['max_nodes']}"
    fig.suptitle(f"typical acceptance vs strict: {result['model']}, n-gram {shape}, "
                 f"greedy, batch 1, {len(result['prompts'])} prompts x {result['max_new_tokens']} tokens "
                 f"(delta = sqrt(eps))", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

