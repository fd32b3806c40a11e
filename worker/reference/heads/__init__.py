"""Draft heads: modules, self-distillation data, training, storage.

High-level entry points:

- ``train_heads(kind, model_name, prompts, out_dir, ...)``: what
  ``specctl train-heads`` runs (load the target, build or reuse the
  distillation set, train, report, save);
- ``ensure_heads(kind, model_name)``: the heads a demo or benchmark uses,
  trained on first use with ``DEFAULT_DATA[kind]`` and ``TrainConfig``'s defaults
  and cached under ``$XDG_CACHE_HOME/specctl/heads/`` (the directory name
  hashes both, so changing a default trains new heads).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

# Torch-free at import (the CLI reads the defaults); heavy modules load in the functions.
from worker.reference.cache import cache_dir
from worker.reference.heads.config import DEFAULT_DATA, GEN_BATCH, KINDS, DistillData, TrainConfig

if TYPE_CHECKING:
    from worker.reference.heads.store import HeadsBundle

__all__ = ["DEFAULT_DATA", "KINDS", "DistillData", "TrainConfig", "default_heads_dir", "ensure_heads", "format_report",
           "train_heads", "usable_cores"]


def default_heads_dir(model_name: str, data: DistillData) -> Path:
    """Cache directory of the heads ``ensure_heads`` trains for ``model_name`` on ``data``."""
    train_defaults = {k: v for k, v in asdict(TrainConfig()).items() if k != "kind"}
    key = hashlib.sha256(json.dumps([model_name, asdict(data), train_defaults], sort_keys=True).encode())
    return cache_dir("heads") / f"{Path(str(model_name)).name}-{key.hexdigest()[:10]}"


def format_report(bundle: "HeadsBundle") -> str:
    """Human-readable held-out accuracy per head position."""
    rep = bundle.meta.get("report", {})
    lines = [f"{bundle.kind} heads {bundle.version}: held-out sequences {rep.get('held_out_sequences')}, "
             f"draft vocab {rep.get('draft_vocab')} (covers {100 * rep.get('draft_vocab_coverage', 0):.1f}% "
             f"of held-out answer tokens)"]
    topk = next((k for k in (rep.get("positions") or [{}])[0] if k.startswith("top") and k != "top1"), "top5")
    lines.append(f"  position   top1    {topk}    n")
    for p in rep.get("positions", []):
        t1 = "  -  " if p["top1"] is None else f"{p['top1']:.3f}"
        tk = "  -  " if p[topk] is None else f"{p[topk]:.3f}"
        lines.append(f"  {p['position']:>8}   {t1}   {tk}   {p['n']}")
    chain = rep.get("mean_accepted_chain", {})
    if chain:
        lines.append("  mean accepted tokens, greedy chain of depth d: "
                     + ", ".join(f"{k}={v:.2f}" for k, v in chain.items()))
    return "\n".join(lines)


def train_heads(
    kind: str,
    model_name: str,
    prompts: str,
    out_dir: str | Path,
    config: TrainConfig | None = None,
    max_new_tokens: int = DistillData.max_new_tokens,
    gen_batch: int = GEN_BATCH,
    limit: int = 0,
    extra_text: list[str] | None = None,
    extra_tokens: int = 50_000,
    samples: int | None = None,
    temperature: float = DistillData.temperature,
    tune_kernels: bool = True,
    jobs: int = 0,
    train_threads: int = 0,
    log=print,
) -> "HeadsBundle":
    """Load the target, distil, train ``kind`` heads, save them in ``out_dir``.

    ``samples``: sampled answers (at ``temperature``) per training prompt on
    top of the greedy one (default: ``DEFAULT_DATA[kind].samples``); held-out
    prompts get none. ``tune_kernels``: the
    target answers on row-count-aware CPU kernels (``worker.reference.engine.kernels``;
    the heads learn nothing different, the answers come faster). ``jobs``:
    processes that answer the distillation parts not cached yet at once, one
    target copy each at this process's torch threads (0 = as many as the
    machine's cores hold; the parts come out the same either way).
    ``train_threads``: torch threads while the heads train (0 = this
    process's); one training process alone on the machine gains from all its
    cores (an EAGLE step at the real sizes ran 1.65× faster on two threads
    than on one, on a 2-core EPYC with nothing else running).

    The target loads on the process's default device
    (``worker.reference.models.set_default_device``, ``--device``); off the
    CPU this process answers everything there (``jobs`` is 1: processes of
    their own would each load a CPU copy) and the heads train there.
    """
    import torch

    from worker.reference.heads.data import ModelLoader, build_distill_set
    from worker.reference.heads.train import train
    from worker.reference.models import load_model
    from worker.reference.prompts import held_out, load_prompts

    if kind not in KINDS:
        raise ValueError(f"unknown drafter {kind!r} for train-heads: expected one of {KINDS}")
    if samples is None:
        samples = DEFAULT_DATA[kind].samples
    config = config or TrainConfig(kind=kind)
    config.kind = kind
    lm = load_model(model_name, tune_kernels=tune_kernels, log=log)
    items = load_prompts(prompts)
    if limit:
        items = items[:limit]
    model_key = lm.path.name
    log(f"target {model_name} ({lm.source}); {len(items)} prompts from {prompts}; "
        f"answers of up to {max_new_tokens} tokens" + (f", {samples} sampled (T={temperature}) per training prompt"
                                                        if samples else ""))
    test = {p.id for p in held_out(items, config.held_out)}
    threads = torch.get_num_threads()
    off_cpu = next(lm.model.parameters()).device.type != "cpu"
    if off_cpu and jobs > 1:
        log(f"--jobs {jobs}: off the CPU the answers come from this process's model only")
    jobs = 1 if off_cpu else jobs or max(1, usable_cores() // threads)
    ds = build_distill_set(lm.model, lm.tokenizer, items, model_key, max_new_tokens=max_new_tokens, batch=gen_batch,
                           samples=samples, temperature=temperature,
                           sample_prompts=[p for p in items if p.id not in test], jobs=jobs,
                           loader=ModelLoader(str(model_name), tune_kernels, threads))
    log(f"distillation set: {len(ds)} sequences, {sum(len(s) for s in ds.sequences)} tokens "
        f"({len(ds.answer_tokens())} generated by the target)")
    if extra_text:
        from worker.reference.heads.data import extend_with_text

        ds = extend_with_text(ds, lm.model, lm.tokenizer, extra_text, max_tokens=extra_tokens, batch=gen_batch)
        log(f"plus {len(extra_text)} extra text file(s): {len(ds)} sequences in all")
    for p in lm.model.parameters():
        p.requires_grad_(False)
    if train_threads:
        torch.set_num_threads(train_threads)
    try:
        bundle = train(lm.model, ds, config, log=log)
    finally:
        torch.set_num_threads(threads)
    bundle.meta.update({"model": str(model_name), "prompts": str(prompts)})
    bundle.save(out_dir)
    log(format_report(bundle))
    log(f"saved {kind} heads {bundle.version} to {out_dir} ({bundle.meta['train_seconds']} s)")
    return bundle


def usable_cores() -> int:
    """Cores this process may run on."""
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def ensure_heads(kind: str, model_name: str = "smollm2-135m", data: DistillData | None = None, log=print) -> Path:
    """A heads directory holding ``kind`` heads for ``model_name``, trained on
    ``data`` (default ``DEFAULT_DATA[kind]``) on first use: the target answers
    in one process per core, then the heads train on every core."""
    from worker.reference.heads.store import HeadsBundle

    if kind not in KINDS:
        raise ValueError(f"unknown drafter {kind!r}: expected one of {KINDS}")
    data = data or DEFAULT_DATA[kind]
    out = default_heads_dir(model_name, data)
    if not HeadsBundle.exists(out, kind):
        log(f"no cached {kind} heads for {model_name}: training them now (once; cached in {out})")
        train_heads(kind, model_name, data.prompts, out, max_new_tokens=data.max_new_tokens, samples=data.samples,
                    temperature=data.temperature, train_threads=usable_cores(), log=log)
    return out
