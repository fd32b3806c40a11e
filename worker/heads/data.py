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
from dataclasses import dataclass
from pathlib import Path

import torch

from worker.prompts import Prompt, chat_ids

__all__ = ["DistillSet", "SAMPLE_SEP", "build_distill_set", "distill_cache_dir", "draft_vocab"]

_FORMAT = 1
SAMPLE_SEP = "~"  # "<prompt id>~<k>": the k-th sampled answer to a prompt


def distill_cache_dir() -> Path:
    from worker.models import cache_root

    return cache_root().parent / "distill"


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
        as ``worker.prompts.held_out``; extra text, ids ``extra:...``, always
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
def _features(model, sequences: list[list[int]], batch: int, progress) -> list[torch.Tensor]:
    base = getattr(model, model.base_model_prefix)
    device = next(model.parameters()).device
    out: list[torch.Tensor] = [None] * len(sequences)  # type: ignore[list-item]
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))  # similar lengths together
    for start in range(0, len(order), batch):
        idx = order[start : start + batch]
        width = max(len(sequences[i]) for i in idx)
        ids = torch.zeros(len(idx), width, dtype=torch.long)
        mask = torch.zeros(len(idx), width, dtype=torch.long)
        for r, i in enumerate(idx):
            ids[r, : len(sequences[i])] = torch.tensor(sequences[i])
            mask[r, : len(sequences[i])] = 1
        h = base(input_ids=ids.to(device), attention_mask=mask.to(device)).last_hidden_state
        for r, i in enumerate(idx):
            out[i] = h[r, : len(sequences[i])].float().cpu().clone()
        if progress is not None:
            progress.update(len(idx))
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
) -> DistillSet:
    """The target's greedy answers to ``prompts`` (plus ``samples`` sampled
    answers to each of ``sample_prompts``, default ``prompts``) with their
    features. Each part is cached on its own, so adding samples later
    reuses the greedy answers.

    ``encode(text) -> token ids`` defaults to the tokenizer's chat template.
    """
    if samples < 0 or (samples and not temperature > 0):
        raise ValueError(f"samples must be >= 0 with a temperature > 0, got samples={samples}, "
                         f"temperature={temperature}")
    encode = encode or (lambda text: chat_ids(tokenizer, text))
    args = (model, encode, model_key, max_new_tokens, batch, cache, show_progress)
    parts = [_answer_set(*args, prompts, 0.0, 0)]
    for k in range(1, samples + 1):
        parts.append(_answer_set(*args, sample_prompts if sample_prompts is not None else prompts, temperature, k))
    return DistillSet.concat(parts)


def _answer_set(model, encode, model_key: str, max_new_tokens: int, batch: int, cache: bool, show_progress: bool,
                prompts: list[Prompt], temperature: float, seed: int) -> DistillSet:
    """One answer per prompt (greedy, or sampled with ``seed``), features recorded; cached."""
    from tqdm.auto import tqdm

    from worker.engine.engine import Engine

    data_hash = _data_hash(model_key, prompts, max_new_tokens, temperature, seed)
    path = distill_cache_dir() / f"{model_key}-{data_hash}.pt"
    if cache and path.is_file():
        return DistillSet.load(path)
    prompt_ids = [encode(p.text) for p in prompts]
    what = f"sampled answers #{seed} (T={temperature})" if temperature else "target answers"
    # Plain decoding with continuous batching; sampling is the target's own law.
    engine = Engine(model, max_batch=batch, temperature=temperature, seed=seed)
    bar = tqdm(total=len(prompts), desc=f"distill: {what}", unit="prompt", disable=not show_progress)
    reqs = [engine.submit(ids, max_new_tokens, request_id=p.id, on_done=lambda r: bar.update(1))
            for p, ids in zip(prompts, prompt_ids)]
    engine.run()
    bar.close()
    sequences = [ids + r.output for ids, r in zip(prompt_ids, reqs)]

    bar = tqdm(total=len(sequences), desc="distill: target features", unit="seq", disable=not show_progress)
    feats = _features(model, sequences, batch, bar)
    bar.close()
    ids = [p.id + (f"{SAMPLE_SEP}{seed}" if temperature else "") for p in prompts]
    ds = DistillSet(model_key, ids, [p.domain for p in prompts], sequences, [len(i) for i in prompt_ids], feats,
                    data_hash, max_new_tokens)
    if cache:
        ds.save(path)
    return ds


def extend_with_text(ds: DistillSet, model, tokenizer, files: list[str], max_tokens: int = 50_000,
                     chunk_tokens: int = 192, batch: int = 8, show_progress: bool = True) -> DistillSet:
    """Add plain text (e.g. source files) as extra sequences: one forward each
    gives the target's features, and its distributions are the labels, so no
    generation is needed. Extra sequences never enter the held-out split."""
    from tqdm.auto import tqdm

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
    bar = tqdm(total=len(chunks), desc="distill: extra text features", unit="seq", disable=not show_progress)
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
        return torch.arange(vocab_size)
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
    return torch.tensor(sorted(chosen), dtype=torch.long)
