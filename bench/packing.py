"""``specctl bench packing``: what a packed verify saves when rows draft different trees.

The reference engine lays a step's blocks out dense, ``[batch, 1 + max nodes]``;
packed (``worker.reference.engine.packing``) its matrix products run on the
real entries only. This benchmark times the engine's verify call
(``Engine._verify``: decoder forward, LM head on the real entries, acceptance,
KV compaction; what ``specctl calibrate`` times) on SmolLM2 over held-out
prompts, at each batch size, with ``k`` rows drafting one shape and the others
decoding plain, for every ``k`` from 1 to the batch:

- two engines hold the same prompts and verify the same blocks, one packed
  and one padded; rounds alternate which goes first, so both see the
  machine's load alike, and the ratio is packed over padded of the medians
  of each engine's CPU time (``time.process_time``: the process's, torch's
  intra-op threads included; nothing else runs in it);
- every round checks that both accepted the same tokens (greedy
  verification: the layout must not change the output);
- ``k`` = batch is a uniform block: it runs dense in both engines (nothing to
  pack), which shows what the measurement's noise is.

Draft tokens are random, so steps accept little and the contexts grow by
about one token a round in both engines alike. Writes ``packing.json`` and
``packing.png`` (packed / padded per shape and ``k``) to ``--out``.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from worker.reference.threads import set_threads

__all__ = ["PackingRow", "DEFAULT_SHAPES", "run_packing_bench"]

DEFAULT_SHAPES = ("1", "3", "2x4:5", "4x2:6")  # chains d1, d3 and two of the engine benchmark's trees


@dataclass
class PackingRow:
    batch: int
    shape: str
    drafting_rows: int
    dense_tokens: int  # what the padded forward computes: batch · (1 + nodes)
    real_tokens: int  # what the packed one computes: batch + k · nodes
    padded_ms: float
    packed_ms: float
    packed_vs_padded: float
    rounds: int
    same_tokens: bool


def _tree(parents: list[int], rng: random.Random, vocab: int):
    from worker.reference.drafters.base import DraftTree

    return DraftTree(list(parents), [rng.randrange(vocab) for _ in parents], [0.5] * len(parents))


def _shape_parents(text: str) -> list[int]:
    """The parent list of a static shape (``"3"`` a chain, ``"2x4:5"`` a tree): grown best
    first by the drafters' own builder, candidate ``r`` of every node scoring ``0.6 / (r + 1)``."""
    from policies.table import Decision
    from policies.tree import grow_best_first
    from worker.reference.server import parse_static

    d = parse_static(text, Decision.off())
    ranked = [(0.6 / (r + 1), None) for r in range(d.width)]
    return grow_best_first(lambda level, payload: ranked, d.depth, d.width, d.max_nodes).parents


def run_packing_bench(out_dir: str = "bench/results/packing", model_name: str = "smollm2-135m",
                      batches=(4, 8), shapes=DEFAULT_SHAPES, rounds: int = 15, threads: int = 1,
                      kernels: str = "tuned", plot: bool = True) -> int:
    from bench.engine import eval_and_warmup_prompts
    from worker.reference.engine.engine import Engine
    from worker.reference.models import load_model
    from worker.reference.progress import ProgressBar
    from worker.reference.prompts import chat_ids

    set_threads(threads)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lm = load_model(model_name, tune_kernels=kernels == "tuned", log=None)
    model, tok = lm.model, lm.tokenizer
    for p in model.parameters():
        p.requires_grad_(False)
    vocab = model.config.vocab_size
    items, _ = eval_and_warmup_prompts(max(batches), 0)
    ids = [chat_ids(tok, p.text) for p in items]
    rows: list[PackingRow] = []
    cells = [(b, s, k) for b in batches for s in shapes for k in range(1, b + 1)]
    bar = ProgressBar(len(cells), "packing")
    started = time.perf_counter()
    with torch.inference_mode():
        for batch, shape, k in cells:
            parents = _shape_parents(shape)
            engines = {layout: Engine(model, None, max_batch=batch, eos_token_id=-1, packed=layout == "packed")
                       for layout in ("packed", "padded")}
            for engine in engines.values():
                for p in ids[:batch]:
                    engine.submit(p, 10_000)
                engine._admit()
            rng = random.Random(batch * 1000 + k)
            times = {"packed": [], "padded": []}
            same = True
            for r in range(rounds + 2):  # the first two warm up
                trees = [_tree(parents if i < k else [], rng, vocab) for i in range(batch)]
                order = ("packed", "padded") if r % 2 == 0 else ("padded", "packed")
                got = {}
                for layout in order:
                    engine = engines[layout]
                    roots = [row.tokens[-1] for row in engine.rows]
                    t0 = time.process_time()
                    outcomes, _ = engine._verify(roots, trees)
                    spent = time.process_time() - t0
                    for row, o in zip(engine.rows, outcomes):
                        row.tokens.extend(o.tokens)
                    got[layout] = [o.tokens for o in outcomes]
                    if r >= 2:
                        times[layout].append(spent * 1000.0)
                same &= got["packed"] == got["padded"]
            padded, packed = statistics.median(times["padded"]), statistics.median(times["packed"])
            nodes = len(parents)
            rows.append(PackingRow(batch, shape, k, batch * (1 + nodes), batch + k * nodes, round(padded, 2),
                                   round(packed, 2), round(packed / padded, 3), rounds, same))
            bar.show(last=f"b{batch} {shape} k={k} {packed / padded:.3f}").update(1)
            del engines
    bar.close()
    if not all(r.same_tokens for r in rows):
        raise AssertionError("packed and padded verification accepted different tokens")
    result = {
        "model": model_name, "threads": torch.get_num_threads(), "kernels": kernels, "rounds": rounds,
        "seconds": round(time.perf_counter() - started, 1),
        "method": ("Engine._verify (decoder forward, LM head on real entries, greedy acceptance, KV compaction) on "
                   "held-out prompts; per batch, shape and k: k rows draft the shape with random tokens, the rest "
                   "plain; two engines (packed, padded) hold the same prompts and verify the same blocks, the "
                   "order alternating every round; two warm-up rounds, then the median of `rounds` calls' process "
                   "CPU time per engine; every round checks both accepted the same tokens"),
        "rows": [asdict(r) for r in rows],
    }
    (out / "packing.json").write_text(json.dumps(result, indent=1))
    print(f"{'batch':>5} {'shape':>6} {'k':>3} {'dense':>6} {'real':>5} {'padded ms':>10} {'packed ms':>10} {'ratio':>6}")
    for r in rows:
        print(f"{r.batch:>5} {r.shape:>6} {r.drafting_rows:>3} {r.dense_tokens:>6} {r.real_tokens:>5} "
              f"{r.padded_ms:>10.2f} {r.packed_ms:>10.2f} {r.packed_vs_padded:>6.3f}")
    if plot:
        _plot(rows, out / "packing.png")
    return 0


def _plot(rows: list[PackingRow], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({r.batch for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(6 * len(batches), 4.2), squeeze=False)
    for ax, batch in zip(axes[0], batches):
        for shape in dict.fromkeys(r.shape for r in rows):
            sel = [r for r in rows if r.batch == batch and r.shape == shape]
            ax.plot([r.drafting_rows for r in sel], [r.packed_vs_padded for r in sel], marker="o",
                    label=f"{shape} ({len(_shape_parents(shape))} nodes)")
            ax.plot([r.drafting_rows for r in sel], [r.real_tokens / r.dense_tokens for r in sel], ls=":",
                    color=ax.lines[-1].get_color(), alpha=0.6)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xticks(range(1, batch + 1))
        ax.set_xlabel("rows drafting (the rest decode plain)")
        ax.set_ylabel("verify CPU time, packed / padded")
        ax.set_title(f"batch {batch} (dotted: real / dense tokens)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
