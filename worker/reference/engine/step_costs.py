"""``specctl calibrate``: a table of the served model's step costs, measured on the device it runs on.

One run times two things over a grid and writes one JSON table, in the
schema of ``worker/sim/hardware_tables/`` (keys ``info``, ``model``,
``verify``, ``draft``), which serves twice:

- as the worker's ``Hello.calibration`` (``specctl worker --calibration
  FILE``, :func:`load_calibration`): the controller's cost model starts from
  it instead of from a start-up timing;
- as a simulator hardware profile (a scenario worker's ``cost_table: FILE``,
  priced by ``worker.sim.measured.MeasuredCostModel``).

``verify`` rows: ``Engine._verify`` itself (the engine's step minus
drafting: the decoder forward over every row's ``[root | nodes]`` block,
masked on the CPU and cascaded elsewhere, the LM head on the real entries,
greedy acceptance, KV compaction, a wait for the device) for ``batch`` rows
of ``tokens_per_request`` tokens (1 = a plain decode step, 1 + a chain of
draft nodes otherwise) over ``context`` cached tokens per row. The cache
holds random keys and values and the weights may be random too: what a
forward costs does not depend on the numbers it multiplies. After each timed
call the cache is cut back to ``context``, so every repeat sees the same
shape.

``draft`` rows: one level of an EAGLE head (``fc`` over ``[feature ;
token embedding]``, one decoder layer attending the head's one-layer KV of
``context`` pairs plus the new ones, the norm, the draft LM head, softmax and
top-``width``) for ``batch`` requests of ``width`` tokens each: the trained
heads when the model has some (``--heads``, or the ones ``ensure_heads``
cached for it), else a head of the same shape on random weights; ``info``
says which.

Each shape is timed once to warm up, then ``repeats`` times round-robin over
the tokens (widths) of one cache, so a slow moment of a shared machine falls
on every shape alike rather than on a run of neighbours, and the median is
kept. On the CPU the clock is wall time; on CUDA each call sits between two
CUDA events and ends in a synchronize, eagerly (no CUDA graph), as the
reference engine runs.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "DEFAULT_GRIDS",
    "MAX_HELLO_SAMPLES",
    "SHAPES",
    "StepGrid",
    "build_shape_model",
    "calibration_samples",
    "dump_step_table",
    "load_calibration",
    "load_step_table",
    "measure_step_table",
    "model_shapes",
    "parse_axis",
    "shape_weight_bytes",
    "table_calibration",
]

MAX_HELLO_SAMPLES = 256  # worker.proto: Hello.calibration holds at most 256 samples
MAX_REPEATS = 64  # VerifySample.repeats: 1..64
CPU_SHAPE_LIMIT_BYTES = 4e9  # a random-weight shape bigger than this is refused on the CPU

# Grids by device type: the CPU's is what the reference worker serves there
# (batch <= 8, trees of up to ~16 tokens, short chats); the GPU's is the
# H200 table's (worker/sim/hardware_tables/README.md).
DEFAULT_GRIDS: dict[str, dict[str, str | int]] = {
    "cpu": dict(batches="1,2,4,8", tokens="1,2,4,8,16", contexts="128,512,2048", widths="1,2,4", repeats=5,
                max_kv_tokens=1 << 19),
    "cuda": dict(batches="1,2,4,8,16,32,64,128,256", tokens="1,2,4,8,16", contexts="1024,8192,32768",
                 widths="1,4,8", repeats=15, max_kv_tokens=1 << 19),
}

# Random-weight models by name (transformers LlamaConfig arguments).
SHAPES: dict[str, dict[str, Any]] = {
    # Llama-3-8B: hidden 4096, 32 query / 8 KV heads of 128, FFN 14336, 32 layers, 128k vocabulary.
    "llama-3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                       tie_word_embeddings=False),
    # worker.reference.models.tiny_llama's shape (tests, quick looks).
    "tiny": dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False),
}
SHAPE_DRAFT_VOCAB = {"llama-3-8b": 32000}  # EAGLE-3's draft vocabulary; smaller models: min(8192, vocab)


# -- the grid -------------------------------------------------------------------------------
def parse_axis(option: str, text: str, low: int = 1, high: int = 1 << 24, min_values: int = 2) -> tuple[int, ...]:
    """``"1,2,4"`` -> ``(1, 2, 4)``: sorted distinct integers in ``low..high``.

    ``ValueError`` naming ``option`` and the offending value otherwise; at
    least ``min_values`` values, since the simulator interpolates between
    grid points along every axis.

    >>> parse_axis("--batches", "4, 1,2,2")
    (1, 2, 4)
    >>> parse_axis("--batches", "1,x")
    Traceback (most recent call last):
    ...
    ValueError: --batches: 'x' is not an integer (expected a comma-separated list such as 1,2,4)
    """
    values = []
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        try:
            value = int(part)
        except ValueError:
            raise ValueError(f"{option}: {part!r} is not an integer (expected a comma-separated list such as "
                             "1,2,4)") from None
        if not low <= value <= high:
            raise ValueError(f"{option}: {value} is out of range (each value must be in {low}..{high})")
        values.append(value)
    axis = tuple(sorted(set(values)))
    if len(axis) < min_values:
        raise ValueError(f"{option}: {text!r} gives {len(axis)} distinct value(s); the table needs at least "
                         f"{min_values} per axis (the simulator interpolates between them)")
    return axis


@dataclass(frozen=True)
class StepGrid:
    """What to time: verify at batches × tokens × contexts, drafting at batches × widths × contexts.

    Shapes whose cache would pass ``max_kv_tokens`` (``batch · context``)
    are left out, as the H200 table leaves them; every batch must still
    measure the shortest context and the smallest batch every context.
    """

    batches: tuple[int, ...]
    tokens: tuple[int, ...]
    contexts: tuple[int, ...]
    widths: tuple[int, ...]
    repeats: int = 5
    max_kv_tokens: int = 1 << 19

    def __post_init__(self) -> None:
        if not 1 <= self.repeats <= 1000:
            raise ValueError(f"--repeats: {self.repeats} is out of range (1..1000)")
        if self.batches[-1] * self.contexts[0] > self.max_kv_tokens:
            raise ValueError(f"--max-kv-tokens: {self.max_kv_tokens} leaves batch {self.batches[-1]} without a "
                             f"context to measure (batch x shortest context {self.contexts[0]} = "
                             f"{self.batches[-1] * self.contexts[0]}); lower --batches or --contexts")
        if self.batches[0] * self.contexts[-1] > self.max_kv_tokens:
            raise ValueError(f"--max-kv-tokens: {self.max_kv_tokens} leaves context {self.contexts[-1]} unmeasured "
                             f"at every batch (smallest batch {self.batches[0]}); lower --contexts")
        if self.batches[-1] * self.tokens[-1] > 1 << 20:
            raise ValueError(f"--tokens: {self.tokens[-1]} per request at batch {self.batches[-1]} passes "
                             f"{1 << 20} tokens in one forward")

    @classmethod
    def parse(cls, batches: str, tokens: str, contexts: str, widths: str, repeats: int,
              max_kv_tokens: int) -> "StepGrid":
        """From the CLI's strings; ``ValueError`` names the option and the value."""
        return cls(parse_axis("--batches", batches, high=4096), parse_axis("--tokens", tokens, high=1024),
                   parse_axis("--contexts", contexts), parse_axis("--widths", widths, high=1024), int(repeats),
                   int(max_kv_tokens))

    def contexts_at(self, batch: int) -> tuple[int, ...]:
        return tuple(c for c in self.contexts if batch * c <= self.max_kv_tokens)

    @property
    def verify_points(self) -> int:
        return sum(len(self.contexts_at(b)) for b in self.batches) * len(self.tokens)

    @property
    def draft_points(self) -> int:
        return sum(len(self.contexts_at(b)) for b in self.batches) * len(self.widths)


# -- models -----------------------------------------------------------------------------------
def _text_config(model):
    config = model.config
    return getattr(config, "text_config", config)


def model_shapes(model) -> dict[str, Any]:
    """The shapes a table records (and a worker checks a table against)."""
    cfg = _text_config(model)
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    param = next(model.parameters())
    params = sum(p.numel() for p in model.parameters())
    return {
        "hidden": cfg.hidden_size, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
        "ffn": cfg.intermediate_size, "layers": cfg.num_hidden_layers, "vocab": cfg.vocab_size,
        "dtype": str(param.dtype), "params": params, "weight_bytes": params * param.element_size(),
        "kv_bytes_per_token": 2 * cfg.num_hidden_layers * kv_heads * head_dim * param.element_size(),
    }


def shape_weight_bytes(shape: str, dtype: torch.dtype) -> tuple[int, int]:
    """``(params, weight bytes)`` of a :data:`SHAPES` model, without building it."""
    s = SHAPES[shape]
    h, ff, v, layers = s["hidden_size"], s["intermediate_size"], s["vocab_size"], s["num_hidden_layers"]
    heads, kv_heads = s["num_attention_heads"], s["num_key_value_heads"]
    head_dim = h // heads
    attn = h * (heads + 2 * kv_heads) * head_dim + heads * head_dim * h  # q, k, v and o projections
    params = v * h * (1 if s.get("tie_word_embeddings") else 2) + layers * (attn + 3 * h * ff + 2 * h) + h
    return params, params * torch.empty(0, dtype=dtype).element_size()


def build_shape_model(shape: str, device: torch.device, seed: int = 0):
    """A random-weight Llama of a :data:`SHAPES` shape on ``device`` (bf16 off the CPU, fp32 on it).

    ``ValueError`` when the weights would not fit: on the CPU above
    :data:`CPU_SHAPE_LIMIT_BYTES`, on CUDA above the device's free memory.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    if shape not in SHAPES:
        raise ValueError(f"--shape: unknown shape {shape!r} (known: {', '.join(sorted(SHAPES))})")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    params, nbytes = shape_weight_bytes(shape, dtype)
    if device.type == "cpu" and nbytes > CPU_SHAPE_LIMIT_BYTES:
        gb = shape_weight_bytes(shape, torch.bfloat16)[1] / 1e9
        raise ValueError(f"--shape {shape}: {params / 1e9:.1f}e9 parameters ({gb:.0f} GB of bf16 weights, twice that "
                         f"in the CPU's fp32) is a GPU shape; run it with --device cuda on a GPU, or on the CPU "
                         "calibrate the model the worker serves (--model smollm2-135m) or --shape tiny")
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        if nbytes > 0.9 * free:
            raise ValueError(f"--shape {shape}: {nbytes / 1e9:.1f} GB of weights do not fit in {device}'s "
                             f"{free / 1e9:.1f} GB free")
    config = LlamaConfig(**SHAPES[shape], bos_token_id=None, eos_token_id=None, pad_token_id=None,
                         attn_implementation="sdpa")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with torch.device(device):
            model = LlamaForCausalLM._from_config(config, dtype=dtype)
    model = model.to(device=device, dtype=dtype).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


# -- timing ------------------------------------------------------------------------------------
class _Clock:
    """Milliseconds of one call: ``timer`` (wall time) on the CPU, CUDA events + a synchronize on CUDA.

    ``timer`` is a seam for tests: one that moves by the work a call does gives a table whose every
    value is known in advance, on any machine."""

    def __init__(self, device: torch.device, timer: Callable[[], float] = time.perf_counter) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.timer = timer

    def __call__(self, fn: Callable[[], Any]) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(self.device)
            return float(start.elapsed_time(end))
        t0 = self.timer()
        fn()
        return (self.timer() - t0) * 1e3


def _medians(runs: dict[int, Callable[[], float]], repeats: int) -> dict[int, float]:
    """One warm-up call each, then ``repeats`` rounds round-robin; the median per key."""
    for run in runs.values():
        run()
    times: dict[int, list[float]] = {k: [] for k in runs}
    for _ in range(repeats):
        for key, run in runs.items():
            times[key].append(run())
    return {k: statistics.median(v) for k, v in times.items()}


class _VerifyRig:
    """``batch`` rows of ``context`` cached tokens (random KV) in an engine, verified with chains."""

    def __init__(self, engine, batch: int, context: int, tokens: Sequence[int], clock: _Clock,
                 gen: torch.Generator) -> None:
        from worker.reference.drafters.base import DraftTree
        from worker.reference.engine.kv import BatchKV, SlotCache

        self.engine, self.clock = engine, clock
        cfg = _text_config(engine.model)
        shapes = model_shapes(engine.model)
        device, dtype = engine.device, engine.model.dtype
        cache = SlotCache.for_model(engine.model)
        for layer in cache.layers:
            keys = torch.empty(batch, shapes["kv_heads"], context, shapes["head_dim"], device=device, dtype=dtype)
            values = torch.empty_like(keys)
            keys.normal_(), values.normal_()
            layer.set(keys, values, spare=max(tokens) + 1)  # room for the block: the buffer never grows
            del keys, values
        engine.kv = BatchKV(cache, torch.ones(batch, context, dtype=torch.bool, device=device))
        self.context = context
        vocab = cfg.vocab_size
        low = min(100, vocab // 2)  # low ids are a tokenizer's specials; any other id costs the same
        self.roots = torch.randint(low, vocab, (batch,), generator=gen, device="cpu").tolist()
        self.trees = {t: [DraftTree.chain([r] * (t - 1)) for r in self.roots] for t in tokens}

    def run(self, tokens: int) -> float:
        engine, trees = self.engine, self.trees[tokens]
        ms = self.clock(lambda: engine._verify(self.roots, trees))
        for layer in engine.kv.cache.layers:  # cut the cache back: every repeat sees the same context
            layer.length = self.context
        engine.kv.valid = engine.kv.valid[:, : self.context]
        return ms

    def close(self) -> None:
        from worker.reference.engine.kv import BatchKV

        self.engine.kv = BatchKV.empty(self.engine.model, self.engine.device)


@dataclass
class _DraftHead:
    """The layers one EAGLE level runs, and where they came from (``info.draft``)."""

    head: torch.nn.Module  # worker.reference.heads.modules.EagleHead
    lm_head: torch.nn.Module  # draft LM head (draft vocabulary rows)
    embed: torch.nn.Module  # the target's token embedding
    source: str


def eagle_draft_head(model, model_name: str | None, heads_dir: str | None, seed: int = 0,
                     draft_vocab: int | None = None, log: Callable[[str], None] = print) -> _DraftHead:
    """The trained EAGLE heads of ``model_name`` when there are some (``heads_dir``, or the
    ones ``ensure_heads`` cached), else a head of the same shape on random weights."""
    from worker.reference.drafters.base import draft_lm_head
    from worker.reference.heads.modules import EagleHead
    from worker.reference.heads.store import HeadsBundle

    device, dtype = next(model.parameters()).device, model.dtype
    cfg = _text_config(model)
    directory = heads_dir
    if directory is None and model_name:
        from worker.reference.heads import DEFAULT_DATA, default_heads_dir

        cached = default_heads_dir(model_name, DEFAULT_DATA["eagle"])
        directory = str(cached) if HeadsBundle.exists(cached, "eagle") else None
    if directory is not None:
        bundle = HeadsBundle.load(directory, "eagle")  # FileNotFoundError says how to train them
        if bundle.config.get("hidden") != cfg.hidden_size:
            raise ValueError(f"--heads {directory}: eagle heads of hidden size {bundle.config.get('hidden')}, the "
                             f"model's is {cfg.hidden_size}")
        head = bundle.module.to(device=device, dtype=dtype).eval()
        lm_head = draft_lm_head(model, bundle.vocab_map).to(device=device, dtype=dtype)
        source = (f"trained eagle heads {bundle.version} from {directory} (draft vocabulary "
                  f"{bundle.vocab_map.numel()})")
    else:
        vocab = draft_vocab or min(8192, cfg.vocab_size)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            head = EagleHead(**EagleHead.config_from_target(cfg))
            lm_head = torch.nn.Linear(cfg.hidden_size, vocab, bias=False)
            torch.nn.init.normal_(lm_head.weight, std=0.02)
        head = head.to(device=device, dtype=dtype).eval()
        lm_head = lm_head.to(device=device, dtype=dtype).eval()
        source = (f"no eagle heads for this model: a head of its shape on random weights (fc 2h->h, one decoder "
                  f"layer, draft LM head over {vocab} tokens)")
    for p in [*head.parameters(), *lm_head.parameters()]:
        p.requires_grad_(False)
    log(f"draft: {source}")
    return _DraftHead(head, lm_head, model.get_input_embeddings(), source)


class _DraftRig:
    """``batch`` requests drafting ``width`` tokens each over a head KV of ``context`` pairs."""

    def __init__(self, draft: _DraftHead, batch: int, context: int, widths: Sequence[int], clock: _Clock,
                 gen: torch.Generator) -> None:
        layer = draft.head.layer
        p = next(draft.head.parameters())
        device, dtype = p.device, p.dtype
        hidden = draft.head.fc.out_features
        self.draft, self.clock = draft, clock
        self.past_k = torch.empty(batch, layer.kv_heads, context, layer.head_dim, device=device, dtype=dtype).normal_()
        self.past_v = torch.empty_like(self.past_k).normal_()
        vocab = draft.embed.num_embeddings
        self.inputs = {}
        for w in widths:
            feats = torch.empty(batch, w, hidden, device=device, dtype=dtype).normal_()
            ids = torch.randint(min(100, vocab // 2), vocab, (batch, w), generator=gen, device="cpu").to(device)
            positions = (context + torch.arange(w, device=device))[None].expand(batch, w)
            mask = torch.ones(batch, 1, w, context + w, dtype=torch.bool, device=device)
            self.inputs[w] = (feats, ids, positions, mask)

    @torch.inference_mode()
    def _level(self, width: int) -> list:
        feats, ids, positions, mask = self.inputs[width]
        head = self.draft.head
        embeds = self.draft.embed(ids).to(feats.dtype)
        x = head.fc(torch.cat([feats, embeds], dim=-1))
        out, _, _ = head.layer(x, positions, self.past_k, self.past_v, mask)
        probs = torch.softmax(self.draft.lm_head(head.norm(out)).float(), dim=-1)
        top = probs.topk(min(width, probs.shape[-1]), dim=-1)
        return top.indices.tolist()  # the drafter reads its candidates on the host

    def run(self, width: int) -> float:
        return self.clock(lambda: self._level(width))


# -- the table -----------------------------------------------------------------------------------
def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"CPU {line.split(':', 1)[1].strip()}"
    except OSError:
        pass
    return f"CPU {platform.processor() or platform.machine()}"


def _available_bytes(device: torch.device) -> float:
    if device.type == "cuda":
        return float(torch.cuda.mem_get_info(device)[0])
    try:  # MemAvailable: free memory plus what the page cache would give back
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return math.inf


@torch.inference_mode()
def measure_step_table(model, grid: StepGrid, model_name: str, heads_dir: str | None = None,
                       draft_vocab: int | None = None, seed: int = 0, note: str = "",
                       log: Callable[[str], None] = print,
                       timer: Callable[[], float] = time.perf_counter) -> dict[str, Any]:
    """Time ``model``'s verify and one EAGLE draft level over ``grid`` on the model's device.

    Returns the table (``info``, ``model``, ``verify``, ``draft``); ``log``
    gets a line per cache measured. ``model_name`` names the model in the
    table (and finds its cached heads, when it is a name ``ensure_heads``
    knows); ``note`` goes into ``info.source``. ``timer`` (seconds) times each
    call on the CPU (CUDA times with events).
    """
    from worker.reference.engine.engine import Engine
    from worker.reference.engine.kernels import DRAFT_ROW_GRID, is_tuned, tune_model

    started = time.perf_counter()
    device = next(model.parameters()).device
    shapes = model_shapes(model)
    largest = max(b * c for b in grid.batches for c in grid.contexts_at(b))
    need = largest * shapes["kv_bytes_per_token"] * 1.1
    have = _available_bytes(device)
    if need > 0.8 * have:
        raise ValueError(f"--max-kv-tokens: the largest cache ({largest} tokens, {need / 1e9:.1f} GB of KV) does "
                         f"not fit in the {have / 1e9:.1f} GB free on {device}; lower --max-kv-tokens, --batches "
                         "or --contexts")
    clock = _Clock(device, timer)
    gen = torch.Generator().manual_seed(seed)
    engine = Engine(model, None, max_batch=grid.batches[-1], eos_token_id=-1)
    attention = "cascade (prefix unmasked, tree block masked)" if engine.cascade else "one masked SDPA over the context"
    log(f"calibrating {model_name} on {_device_name(device)}: verify at {grid.verify_points} shapes, one draft level "
        f"at {grid.draft_points}, {grid.repeats} repeats each")

    verify: list[dict[str, Any]] = []
    for batch in grid.batches:
        for context in grid.contexts_at(batch):
            rig = _VerifyRig(engine, batch, context, grid.tokens, clock, gen)
            ms = _medians({t: (lambda t=t: rig.run(t)) for t in grid.tokens}, grid.repeats)
            rig.close()
            del rig
            for t in grid.tokens:
                verify.append({"batch": batch, "tokens_per_request": t, "context": context, "batch_tokens": batch * t,
                               "kv_tokens": batch * context, "verify_ms": round(ms[t], 4)})
            log(f"  verify batch {batch:>4} context {context:>6}: "
                + "  ".join(f"{t} tok {ms[t]:.2f} ms" for t in grid.tokens))
    del engine

    draft_head = eagle_draft_head(model, model_name, heads_dir, seed, draft_vocab, log)
    if is_tuned(model):  # as build_drafter does: the heads on tuned kernels too, lossy ones allowed
        tune_model(torch.nn.ModuleDict({"head": draft_head.head, "lm_head": draft_head.lm_head}), allow_lossy=True,
                   rows=DRAFT_ROW_GRID, log=log)
    draft: list[dict[str, Any]] = []
    for batch in grid.batches:
        for context in grid.contexts_at(batch):
            drig = _DraftRig(draft_head, batch, context, grid.widths, clock, gen)
            ms = _medians({w: (lambda w=w: drig.run(w)) for w in grid.widths}, grid.repeats)
            del drig
            for w in grid.widths:
                draft.append({"batch": batch, "width": w, "context": context, "draft_level_ms": round(ms[w], 4)})
            log(f"  draft  batch {batch:>4} context {context:>6}: "
                + "  ".join(f"width {w} {ms[w]:.3f} ms" for w in grid.widths))

    seconds = time.perf_counter() - started
    clock_text = "CUDA events around each call, then a synchronize" if clock.cuda else "wall time (perf_counter)"
    info = {
        "device": _device_name(device),
        "device_type": device.type,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "kernels": "tuned (worker.reference.engine.kernels)" if is_tuned(model) else "torch defaults",
        "attention": attention,
        "repeats": grid.repeats,
        "max_kv_tokens": grid.max_kv_tokens,
        "draft": draft_head.source,
        "source": note or model_name,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "seconds": round(seconds, 1),
        "method": ("specctl calibrate (worker/reference/engine/step_costs.py): verify = Engine._verify (decoder "
                   "forward over [root | chain] blocks, LM head on real entries, greedy acceptance, KV compaction) "
                   "over a cache of random keys and values; draft = one EAGLE level (fc, one decoder layer over the "
                   "head's one-layer KV, norm, draft LM head, softmax, top-width); one warm-up call per shape, then "
                   f"the median of {grid.repeats} calls round-robin over the tokens (widths) of one cache; "
                   f"{clock_text}; eager, as the reference engine runs."),
    }
    return {"info": info, "model": {"name": model_name, **shapes,
                                    "draft_vocab": int(draft_head.lm_head.weight.shape[0])},
            "verify": verify, "draft": draft}


# -- the table as Hello.calibration --------------------------------------------------------------
_VERIFY_KEYS = ("batch", "tokens_per_request", "context", "batch_tokens", "kv_tokens", "verify_ms")
_DRAFT_KEYS = ("batch", "width", "context", "draft_level_ms")


def dump_step_table(table: dict[str, Any]) -> str:
    """The table as JSON text: ``info`` and ``model`` indented, one line per row."""
    head = {k: v for k, v in table.items() if k not in ("verify", "draft")}
    text = json.dumps(head, indent=1)[:-2]  # without the closing brace
    for key in ("verify", "draft"):
        rows = ",\n  ".join(json.dumps(r) for r in table[key])
        text += f',\n "{key}": [\n  {rows}\n ]'
    return text + "\n}\n"


def load_step_table(path: str | Path) -> dict[str, Any]:
    """A table file, its rows checked for the schema's keys (``ValueError`` names what is missing)."""
    path = Path(path)
    try:
        table = json.loads(path.read_text())
    except OSError as err:
        raise FileNotFoundError(f"step-cost table {path}: {err.strerror}") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"step-cost table {path}: not JSON ({err})") from None
    if not isinstance(table, dict):
        raise ValueError(f"step-cost table {path}: expected an object with info, model, verify and draft")
    for key, columns in (("verify", _VERIFY_KEYS), ("draft", _DRAFT_KEYS)):
        rows = table.get(key)
        if not isinstance(rows, list) or not rows:
            raise ValueError(f"step-cost table {path}: no {key!r} rows")
        for i, row in enumerate(rows):
            missing = [c for c in columns if not isinstance(row, dict) or c not in row]
            if missing:
                raise ValueError(f"step-cost table {path}: {key}[{i}] lacks {', '.join(missing)}")
    if not isinstance(table.get("model"), dict):
        raise ValueError(f"step-cost table {path}: no 'model' section")
    return table


def table_calibration(table: dict[str, Any], limit: int = MAX_HELLO_SAMPLES):
    """The table's verify rows as ``Hello.calibration`` entries
    (:class:`worker.reference.engine.calibrate.VerifyTiming`), at most ``limit``.

    A larger table gives an evenly spaced subset of its rows in (batch,
    tokens, context) order, so every batch size and the grid's corners
    stay represented. ``repeats`` is the table's, capped at 64 (the proto's
    range).

    >>> rows = [{"batch": b, "tokens_per_request": t, "context": 64, "batch_tokens": b * t,
    ...          "kv_tokens": 64 * b, "verify_ms": 1.0 + t} for b in (1, 2) for t in (1, 2, 4)]
    >>> [(s.batch_size, s.batch_tokens) for s in table_calibration({"verify": rows, "info": {"repeats": 5}}, limit=4)]
    [(1, 1), (1, 4), (2, 2), (2, 8)]
    """
    from worker.reference.engine.calibrate import VerifyTiming

    if limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    rows = sorted(table["verify"], key=lambda r: (r["batch"], r["tokens_per_request"], r["context"]))
    if len(rows) > limit:
        n = len(rows)
        picks = sorted({round(i * (n - 1) / (limit - 1)) for i in range(limit)}) if limit > 1 else [0]
        rows = [rows[i] for i in picks]
    repeats = int(min(max(int((table.get("info") or {}).get("repeats", 1)), 1), MAX_REPEATS))
    return [VerifyTiming(int(r["batch"]), int(r["batch_tokens"]), int(r["kv_tokens"]), float(r["verify_ms"]), repeats)
            for r in rows]


def calibration_samples(table: dict[str, Any], limit: int = MAX_HELLO_SAMPLES) -> list:
    """The table as ``worker_pb2.VerifySample`` rows (see :func:`table_calibration`)."""
    from protos.speculation.v1 import worker_pb2

    return [worker_pb2.VerifySample(batch_size=t.batch_size, batch_tokens=t.batch_tokens, kv_tokens=t.kv_tokens,
                                    verify_ms=t.verify_ms, repeats=t.repeats)
            for t in table_calibration(table, limit)]


_SHAPE_KEYS = ("layers", "hidden", "heads", "kv_heads", "head_dim", "vocab")


def load_calibration(path: str | Path, model=None, limit: int = MAX_HELLO_SAMPLES):
    """A table file as ``Hello.calibration`` entries for ``model``.

    ``ValueError`` when the table was measured on other shapes than
    ``model``'s (its costs would be another model's).
    """
    table = load_step_table(path)
    if model is not None:
        mine, theirs = model_shapes(model), table["model"]
        differ = [f"{k} {theirs.get(k)} (served: {mine[k]})" for k in _SHAPE_KEYS
                  if k in theirs and int(theirs[k]) != int(mine[k])]
        if differ:
            raise ValueError(f"--calibration {path}: measured on another model ({theirs.get('name', '?')}: "
                             f"{', '.join(differ)}); run `specctl calibrate` with the served model")
    return table_calibration(table, limit)
