"""Self-distillation data: the frozen target answers prompts greedily, then one
forward over prompt + answer records its features (last hidden state after
the final norm) at every position.

With ``samples > 0`` the target also answers every training prompt that
many more times *sampled* at a temperature (the engine's lossless
sampling): more of the target's own text from the same prompts, so the
heads see more continuations than one greedy answer per prompt. A sampled
sequence's id is ``<prompt id>~<k>``; it follows its prompt in the
held-out split.

Both Medusa and EAGLE heads learn from the same ``DistillSet``; it is cached
under ``$XDG_CACHE_HOME/specctl/distill/`` keyed by the model, the prompts
and the generation settings, so training the second kind of head skips the
generation (the slow part on a CPU).
"""

from __future__ import annotations

import hashlib
import json
import zlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from worker.reference.cache import cache_dir
from worker.reference.progress import ProgressBar
from worker.reference.prompts import Prompt, chat_ids

__all__ = ["AnswerSpec", "DistillSet", "ModelLoader", "SAMPLE_SEP", "answer_in_processes", "build_distill_set",
           "distill_cache_dir", "draft_vocab"]

_FORMAT = 1
SAMPLE_SEP = "~"  # "<prompt id>~<k>": the k-th sampled answer to a prompt


def distill_cache_dir() -> Path:
    return cache_dir("distill")


@dataclass
class DistillSet:
    """Sequences (prompt + the target's greedy answer) and their features."""

    model_key: str
    ids: list[str]
    domains: list[str]
    sequences: list[list[int]]
    prompt_lens: list[int]
    features: list[torch.Tensor]  # [L_i, hidden], fp16 on disk, fp32 in use
    data_hash: str
    max_new_tokens: int

    def __len__(self) -> int:
        return len(self.sequences)

    def split(self, held_out: float = 0.1) -> tuple[list[int], list[int]]:
        """Deterministic train / held-out indices (by a hash of each prompt id,
        as ``worker.reference.prompts.held_out``; extra text, ids ``extra:...``, always
        trains). Held out are the *greedy* answers only: a sampled answer
        (``<id>~<k>``) to a held-out prompt is neither trained on nor
        tested."""
        train, test = [], []
        for i, pid in enumerate(self.ids):
            if pid.startswith("extra:"):
                train.append(i)
                continue
            base, sampled, _ = pid.partition(SAMPLE_SEP)
            if zlib.crc32(base.encode()) % 1000 >= held_out * 1000:
                train.append(i)
            elif not sampled:
                test.append(i)
        if not test and len(train) > 1:
            test.append(train.pop())
        return train, test

    def answer_tokens(self, idx: list[int] | None = None) -> list[int]:
        idx = range(len(self)) if idx is None else idx
        return [t for i in idx for t in self.sequences[i][self.prompt_lens[i] :]]

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save({"format": _FORMAT, "model_key": self.model_key, "ids": self.ids, "domains": self.domains,
                    "sequences": self.sequences, "prompt_lens": self.prompt_lens,
                    "features": [f.to(torch.float16) for f in self.features], "data_hash": self.data_hash,
                    "max_new_tokens": self.max_new_tokens}, tmp)
        tmp.replace(path)

    @classmethod
    def concat(cls, parts: list["DistillSet"]) -> "DistillSet":
        """One set holding every part's sequences (same model and answer length)."""
        first = parts[0]
        h = hashlib.sha256()
        for part in parts:
            if (part.model_key, part.max_new_tokens) != (first.model_key, first.max_new_tokens):
                raise ValueError(f"cannot join distill sets of {part.model_key}/{part.max_new_tokens} tokens and "
                                 f"{first.model_key}/{first.max_new_tokens} tokens")
            h.update(part.data_hash.encode())
        return cls(first.model_key, [i for p in parts for i in p.ids], [d for p in parts for d in p.domains],
                   [s for p in parts for s in p.sequences], [n for p in parts for n in p.prompt_lens],
                   [f for p in parts for f in p.features], h.hexdigest()[:16] if len(parts) > 1 else first.data_hash,
                   first.max_new_tokens)

    @classmethod
    def load(cls, path: Path) -> "DistillSet":
        d = torch.load(path, weights_only=True)
        if d.get("format") != _FORMAT:
            raise ValueError(f"{path}: distill format {d.get('format')} != {_FORMAT}")
        return cls(d["model_key"], d["ids"], d["domains"], d["sequences"], d["prompt_lens"],
                   [f.to(torch.float32) for f in d["features"]], d["data_hash"], d["max_new_tokens"])


def _data_hash(model_key: str, prompts: list[Prompt], max_new_tokens: int, temperature: float = 0.0,
               seed: int = 0) -> str:
    h = hashlib.sha256()
    # Greedy sets keep the key they always had; sampled ones add their law and seed.
    h.update(json.dumps([_FORMAT, model_key, max_new_tokens] + ([temperature, seed] if temperature else [])).encode())
    for p in prompts:
        h.update(json.dumps([p.id, p.domain, p.text]).encode())
    return h.hexdigest()[:16]


@torch.inference_mode()
def _features(model, sequences: list[list[int]], batch: int, progress: ProgressBar | None,
              tick: Callable[[int], None] | None = None) -> list[torch.Tensor]:
    base = getattr(model, model.base_model_prefix)
    device = next(model.parameters()).device
    out: list[torch.Tensor] = [None] * len(sequences)  # type: ignore[list-item]
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))  # similar lengths together
    for start in range(0, len(order), batch):
        idx = order[start : start + batch]
        width = max(len(sequences[i]) for i in idx)
        ids = torch.zeros(len(idx), width, dtype=torch.long, device="cpu")  # host, then one copy each
        mask = torch.zeros(len(idx), width, dtype=torch.long, device="cpu")
        for r, i in enumerate(idx):
            ids[r, : len(sequences[i])] = torch.tensor(sequences[i], device="cpu")
            mask[r, : len(sequences[i])] = 1
        h = base(input_ids=ids.to(device), attention_mask=mask.to(device)).last_hidden_state
        for r, i in enumerate(idx):
            out[i] = h[r, : len(sequences[i])].float().cpu().clone()
        if progress is not None:
            progress.update(len(idx))
        if tick is not None:
            tick(len(idx))
    return out


def build_distill_set(
    model,
    tokenizer,
    prompts: list[Prompt],
    model_key: str,
    max_new_tokens: int = 64,
    batch: int = 8,
    cache: bool = True,
    show_progress: bool = True,
    encode=None,
    samples: int = 0,
    temperature: float = 0.8,
    sample_prompts: list[Prompt] | None = None,
    jobs: int = 1,
    loader: ModelLoader | None = None,
) -> DistillSet:
    """The target's greedy answers to ``prompts`` (plus ``samples`` sampled
    answers to each of ``sample_prompts``, default ``prompts``) with their
    features. Each part is cached on its own, so adding samples later
    reuses the greedy answers.

    ``encode(text) -> token ids`` defaults to the tokenizer's chat template.
    ``jobs > 1`` with a ``loader`` answers the parts not cached yet in that
    many processes at once, each with its own copy of the target (see
    :func:`answer_in_processes`); the parts are the same as when answered
    one after the other.
    """
    if samples < 0 or (samples and not temperature > 0):
        raise ValueError(f"samples must be >= 0 with a temperature > 0, got samples={samples}, "
                         f"temperature={temperature}")
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got jobs={jobs}")
    encode = encode or (lambda text: chat_ids(tokenizer, text))
    sampled = sample_prompts if sample_prompts is not None else prompts
    ids = {p.text: encode(p.text) for p in [*prompts, *sampled]}
    specs = [AnswerSpec(model_key, prompts, [ids[p.text] for p in prompts], max_new_tokens, 0.0, 0)]
    specs += [AnswerSpec(model_key, sampled, [ids[p.text] for p in sampled], max_new_tokens, temperature, k)
              for k in range(1, samples + 1)]
    missing = [s for s in specs if not (cache and s.path().is_file())]
    if jobs > 1 and loader is not None and cache and len(missing) > 1:
        answer_in_processes(loader, missing, batch, jobs, show_progress)
    return DistillSet.concat([_answer_set(model, spec, batch, cache, show_progress) for spec in specs])


@dataclass(frozen=True)
class ModelLoader:
    """How a child process loads its own copy of the target: ``load_model``'s
    name or path, the kernel choice, and torch threads (set before loading,
    so a tuned kernel table cached for that thread count is reused)."""

    name_or_path: str
    tune_kernels: bool = False
    threads: int = 1


@dataclass(frozen=True)
class AnswerSpec:
    """One part of a distillation set: one answer per prompt, greedy
    (``temperature == 0``) or sampled with ``seed``."""

    model_key: str
    prompts: list[Prompt]
    prompt_ids: list[list[int]]
    max_new_tokens: int
    temperature: float
    seed: int

    def data_hash(self) -> str:
        return _data_hash(self.model_key, self.prompts, self.max_new_tokens, self.temperature, self.seed)

    def path(self) -> Path:
        return distill_cache_dir() / f"{self.model_key}-{self.data_hash()}.pt"

    def describe(self) -> str:
        return f"sampled answers #{self.seed} (T={self.temperature})" if self.temperature else "target answers"


def _answer_set(model, spec: AnswerSpec, batch: int, cache: bool, show_progress: bool,
                tick: Callable[[int], None] | None = None) -> DistillSet:
    """One answer per prompt (greedy, or sampled with ``seed``), features
    recorded; cached. ``tick(n)`` hears of every ``n`` prompts answered and
    ``n`` sequences featurised."""
    from worker.reference.engine.engine import Engine

    path = spec.path()
    if cache and path.is_file():
        return DistillSet.load(path)
    # Plain decoding with continuous batching; sampling is the target's own law.
    engine = Engine(model, max_batch=batch, temperature=spec.temperature, seed=spec.seed)
    bar = ProgressBar(len(spec.prompts), f"distill: {spec.describe()}", enabled=show_progress)

    def answered(_request) -> None:
        bar.update(1)
        if tick is not None:
            tick(1)

    reqs = [engine.submit(ids, spec.max_new_tokens, request_id=p.id, on_done=answered)
            for p, ids in zip(spec.prompts, spec.prompt_ids)]
    engine.run()
    bar.close()
    sequences = [ids + r.output for ids, r in zip(spec.prompt_ids, reqs)]

    bar = ProgressBar(len(sequences), "distill: target features", enabled=show_progress)
    feats = _features(model, sequences, batch, bar, tick)
    bar.close()
    ids = [p.id + (f"{SAMPLE_SEP}{spec.seed}" if spec.temperature else "") for p in spec.prompts]
    ds = DistillSet(spec.model_key, ids, [p.domain for p in spec.prompts], sequences,
                    [len(i) for i in spec.prompt_ids], feats, spec.data_hash(), spec.max_new_tokens)
    if cache:
        ds.save(path)
    return ds


# --------------------------------------------------------------------------
# answering parts in several processes
# --------------------------------------------------------------------------

_child_model = None
_child_ticks = None
_child_error: Exception | None = None


def _child_start(loader: ModelLoader, ticks) -> None:
    global _child_model, _child_ticks, _child_error
    from worker.reference.models import load_model

    _child_ticks = ticks
    torch.set_num_threads(loader.threads)
    try:
        _child_model = load_model(loader.name_or_path, tune_kernels=loader.tune_kernels, log=None).model
    except Exception as err:  # a pool whose initializer raises respawns it for ever: fail the first task instead
        _child_error = err


def _child_answer(spec: AnswerSpec, batch: int) -> None:
    if _child_error is not None:
        raise _child_error
    with torch.inference_mode():
        _answer_set(_child_model, spec, batch, cache=True, show_progress=False, tick=_child_ticks.put)


def answer_in_processes(loader: ModelLoader, specs: list[AnswerSpec], batch: int, jobs: int,
                        show_progress: bool = True) -> None:
    """Answer ``specs`` in ``min(jobs, len(specs))`` processes, each loading
    the target through ``loader``, and cache every part (``AnswerSpec.path``).

    One process at one torch thread keeps one core busy, so the processes
    use cores a single process leaves idle. Each part's engine, batch order
    and sampling seed are the same as in one process, so the answers are
    too. One bar counts every part's prompts and sequences.
    """
    import multiprocessing as mp
    import queue

    ctx = mp.get_context("spawn")  # fork would copy OpenMP's thread pool state of a busy parent
    ticks = ctx.Queue()
    procs = min(jobs, len(specs))
    total = 2 * sum(len(s.prompts) for s in specs)  # answers, then features
    with (ProgressBar(total, f"distill: {len(specs)} answer sets in {procs} processes", enabled=show_progress) as bar,
          ctx.Pool(procs, initializer=_child_start, initargs=(loader, ticks)) as pool):
        result = pool.starmap_async(_child_answer, [(s, batch) for s in specs], chunksize=1)
        while not result.ready():
            try:
                bar.update(ticks.get(timeout=0.5))
            except queue.Empty:
                pass
        result.get()  # raises what a child raised


def extend_with_text(ds: DistillSet, model, tokenizer, files: list[str], max_tokens: int = 50_000,
                     chunk_tokens: int = 192, batch: int = 8, show_progress: bool = True) -> DistillSet:
    """Add plain text (e.g. source files) as extra sequences: one forward each
    gives the target's features, and its distributions are the labels, so no
    generation is needed. Extra sequences never enter the held-out split."""
    chunks: list[list[int]] = []
    total = 0
    for path in files:
        text = Path(path).read_text(errors="ignore")
        ids = tokenizer(text).input_ids
        for start in range(0, len(ids) - 16, chunk_tokens):
            piece = ids[start : start + chunk_tokens]
            chunks.append(piece)
            total += len(piece)
            if total >= max_tokens:
                break
        if total >= max_tokens:
            break
    bar = ProgressBar(len(chunks), "distill: extra text features", enabled=show_progress)
    feats = _features(model, chunks, batch, bar)
    bar.close()
    h = hashlib.sha256(ds.data_hash.encode())
    for c in chunks:
        h.update(json.dumps(c).encode())
    return DistillSet(ds.model_key, ds.ids + [f"extra:{i}" for i in range(len(chunks))],
                      ds.domains + ["text"] * len(chunks), ds.sequences + chunks, ds.prompt_lens + [0] * len(chunks),
                      ds.features + feats, h.hexdigest()[:16], ds.max_new_tokens)


def draft_vocab(ds: DistillSet, size: int, vocab_size: int, always: tuple[int, ...] = (),
                idx: list[int] | None = None) -> torch.Tensor:
    """The ``size`` most frequent tokens of the answers (then of the prompts,
    then the lowest ids: BPE numbers its merges roughly by frequency),
    sorted; ``always`` (e.g. EOS) are included. Counts the sequences ``idx``
    only (default all): training passes its training split, so held-out
    answers do not leak into the vocabulary.

    Returns long ``[size]`` token ids (``vocab_size`` or fewer when ``size``
    covers the whole vocabulary: then the map is the identity).
    """
    if size <= 0 or size >= vocab_size:
        return torch.arange(vocab_size, device="cpu")
    idx = range(len(ds)) if idx is None else idx
    own = {i for i in idx if not ds.ids[i].startswith("extra:")}
    answers = Counter(ds.answer_tokens(sorted(own)))
    prompts = Counter(t for i in idx for t in (ds.sequences[i][: ds.prompt_lens[i]] if i in own else ds.sequences[i]))
    chosen: list[int] = []
    seen: set[int] = set()

    def take(tokens):
        for t in tokens:
            if len(chosen) >= size:
                return
            if t not in seen and 0 <= t < vocab_size:
                seen.add(t)
                chosen.append(t)

    take(always)
    take(t for t, _ in answers.most_common())
    take(t for t, _ in prompts.most_common())
    take(range(vocab_size))
    return torch.tensor(sorted(chosen), dtype=torch.long, device="cpu")
