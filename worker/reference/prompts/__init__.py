"""Prompt sets written for specctl (JSONL: ``{"id", "domain", "prompt"}``).

Shipped sets: ``chat``, ``code``, ``math``, ``summarise`` (80 prompts each,
short) and ``all`` (the four together). ``load_prompts`` takes a set name or
a path to a JSONL file (or a plain text file, one prompt per line).
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from pathlib import Path

__all__ = ["PROMPT_DIR", "Prompt", "chat_ids", "held_out", "load_prompts", "prompt_sets"]

PROMPT_DIR = Path(__file__).resolve().parent


@dataclass(frozen=True, slots=True)
class Prompt:
    id: str
    domain: str
    text: str


def prompt_sets() -> list[str]:
    return sorted(p.stem for p in PROMPT_DIR.glob("*.jsonl"))


def resolve(name_or_path: str | Path) -> Path:
    path = Path(name_or_path)
    if path.is_file():
        return path
    candidate = PROMPT_DIR / f"{name_or_path}.jsonl"
    if candidate.is_file():
        return candidate
    raise FileNotFoundError(f"no prompt file {name_or_path!r}: expected a path or one of {prompt_sets()}")


def load_prompts(name_or_path: str | Path) -> list[Prompt]:
    """Prompts of a shipped set (``"code"``) or a file (JSONL or one per line).

    >>> ps = load_prompts("all")
    >>> len(ps), sorted({p.domain for p in ps})
    (320, ['chat', 'code', 'math', 'summarise'])
    """
    path = resolve(name_or_path)
    out = []
    for i, line in enumerate(path.read_text().splitlines()):
        line = line.strip()
        if not line:
            continue
        if line.startswith("{"):
            row = json.loads(line)
            out.append(Prompt(str(row.get("id", f"{path.stem}-{i}")), str(row.get("domain", path.stem)),
                              str(row["prompt"])))
        else:
            out.append(Prompt(f"{path.stem}-{i}", path.stem, line))
    return out


def chat_ids(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` as one user turn, ready for the assistant's answer."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True)
        if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return [int(t) for t in ids]
    return [int(t) for t in tokenizer(text).input_ids]


def held_out(prompts: list[Prompt], fraction: float = 0.1) -> list[Prompt]:
    """The prompts ``DistillSet.split`` holds out of head training (crc32 of the id).

    >>> len(held_out(load_prompts("all"))) < 40
    True
    """
    return [p for p in prompts if zlib.crc32(p.id.encode()) % 1000 < fraction * 1000]
