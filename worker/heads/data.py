"""Self-distillation data: the frozen target answers prompts greedily, then one
forward over prompt + answer records its features (last hidden state after
the final norm) at every position.

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

__all__ = ["DistillSet", "build_distill_set", "distill_cache_dir", "draft_vocab"]

_FORMAT = 1


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
        """Deterministic train / held-out indices (by a hash of each prompt id;
        extra text, ids ``extra:...``, always trains)."""
        train, test = [], []
        for i, pid in enumerate(self.ids):
            if pid.startswith("extra:"):
                train.append(i)
                continue
            (test if zlib.crc32(pid.encode()) % 1000 < held_out * 1000 else train).append(i)
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
    def load(cls, path: Path) -> "DistillSet":
        d = torch.load(path, weights_only=True)
        if d.get("format") != _FORMAT:
            raise ValueError(f"{path}: distill format {d.get('format')} != {_FORMAT}")
        return cls(d["model_key"], d["ids"], d["domains"], d["sequences"], d["prompt_lens"],
                   [f.to(torch.float32) for f in d["features"]], d["data_hash"], d["max_new_tokens"])


def _data_hash(model_key: str, prompts: list[Prompt], max_new_tokens: int) -> str:
    h = hashlib.sha256()
    h.update(json.dumps([_FORMAT, model_key, max_new_tokens]).encode())
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
) -> DistillSet:
    """Generate the target's greedy answers and record features (cached).

    ``encode(text) -> token ids`` defaults to the tokenizer's chat template.
    """
    from tqdm.auto import tqdm

    from worker.engine.engine import Engine

    data_hash = _data_hash(model_key, prompts, max_new_tokens)
    path = distill_cache_dir() / f"{model_key}-{data_hash}.pt"
    if cache and path.is_file():
        return DistillSet.load(path)
    encode = encode or (lambda text: chat_ids(tokenizer, text))
    prompt_ids = [encode(p.text) for p in prompts]

    engine = Engine(model, max_batch=batch)  # plain greedy, continuous batching
    bar = tqdm(total=len(prompts), desc="distill: target answers", unit="prompt", disable=not show_progress)
    reqs = [engine.submit(ids, max_new_tokens, request_id=p.id, on_done=lambda r: bar.update(1))
            for p, ids in zip(prompts, prompt_ids)]
    engine.run()
    bar.close()
    sequences = [ids + r.output for ids, r in zip(prompt_ids, reqs)]

    bar = tqdm(total=len(sequences), desc="distill: target features", unit="seq", disable=not show_progress)
    feats = _features(model, sequences, batch, bar)
    bar.close()
    ds = DistillSet(model_key, [p.id for p in prompts], [p.domain for p in prompts], sequences,
                    [len(i) for i in prompt_ids], feats, data_hash, max_new_tokens)
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


def draft_vocab(ds: DistillSet, size: int, vocab_size: int, always: tuple[int, ...] = ()) -> torch.Tensor:
    """The ``size`` most frequent tokens of the answers (then of the prompts,
    then the lowest ids), sorted; ``always`` (e.g. EOS) are included.

    Returns long ``[size]`` token ids (``vocab_size`` or fewer when ``size``
    covers the whole vocabulary: then the map is the identity).
    """
    if size <= 0 or size >= vocab_size:
        return torch.arange(vocab_size)
    own = [i for i, pid in enumerate(ds.ids) if not pid.startswith("extra:")]
    answers = Counter(ds.answer_tokens(own))
    prompts = Counter(t for i, (s, n) in enumerate(zip(ds.sequences, ds.prompt_lens))
                      for t in (s[:n] if i in set(own) else s))
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
