"""Saved draft heads: weights + draft vocabulary + metadata, with a version id.

A heads directory holds ``<kind>.safetensors`` (head weights and
``vocab_map``) and ``<kind>.json`` (kind, sizes, version, training metadata
and the held-out accuracy report), so one directory can carry both a Medusa
and an EAGLE set. The version id is ``<kind>-`` + the first 12 hex digits of
sha256(weights ‖ training-data hash); the worker reports it in its Hello.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from worker.reference.heads.config import KINDS
from worker.reference.heads.modules import EagleHead, MedusaHeads

__all__ = ["HeadsBundle", "KINDS", "heads_version"]


def heads_version(kind: str, state: dict[str, torch.Tensor], data_hash: str) -> str:
    h = hashlib.sha256()
    for key in sorted(state):
        h.update(key.encode())
        h.update(state[key].detach().cpu().contiguous().numpy().tobytes())
    h.update(data_hash.encode())
    return f"{kind}-{h.hexdigest()[:12]}"


@dataclass
class HeadsBundle:
    kind: str
    config: dict  # constructor arguments of the module
    module: torch.nn.Module
    vocab_map: torch.Tensor  # long [draft_vocab] target token ids
    meta: dict = field(default_factory=dict)
    version: str = ""

    @classmethod
    def build(cls, kind: str, config: dict, vocab_map: torch.Tensor, meta: dict | None = None) -> "HeadsBundle":
        if kind == "medusa":
            module = MedusaHeads(config["hidden"], config["num_heads"])
        elif kind == "eagle":
            module = EagleHead(**{k: config[k] for k in ("hidden", "heads", "kv_heads", "head_dim", "intermediate",
                                                          "theta", "eps")})
        else:
            raise ValueError(f"unknown heads kind {kind!r}: expected one of {KINDS}")
        return cls(kind, dict(config), module, vocab_map.long(), dict(meta or {}))

    def seal(self) -> str:
        """Compute and store the version id from the weights and training data."""
        self.version = heads_version(self.kind, self._state(), str(self.meta.get("data_hash", "")))
        return self.version

    def _state(self) -> dict[str, torch.Tensor]:
        # On the host whatever device the heads trained or run on: the file and the version hash see the same bytes.
        state = {f"module.{k}": v.detach().float().cpu().contiguous() for k, v in self.module.state_dict().items()}
        state["vocab_map"] = self.vocab_map.cpu().contiguous()
        return state

    def save(self, directory: str | Path) -> Path:
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        if not self.version:
            self.seal()
        save_file(self._state(), str(directory / f"{self.kind}.safetensors"))
        # The JSON names the version and goes last, atomically: a worker polling
        # the directory never sees a version whose weights are still being written.
        tmp = directory / f".{self.kind}.json.tmp"
        tmp.write_text(json.dumps(
            {"kind": self.kind, "version": self.version, "config": self.config, "meta": self.meta}, indent=1))
        os.replace(tmp, directory / f"{self.kind}.json")
        return directory

    @classmethod
    def load(cls, directory: str | Path, kind: str) -> "HeadsBundle":
        from safetensors.torch import load_file

        directory = Path(directory)
        meta_path = directory / f"{kind}.json"
        weights = directory / f"{kind}.safetensors"
        if not meta_path.is_file() or not weights.is_file():
            raise FileNotFoundError(
                f"no {kind} heads in {directory}: train them with "
                f"`specctl train-heads --drafter {kind} --model MODEL --prompts all --out {directory}`"
            )
        info = json.loads(meta_path.read_text())
        state = load_file(str(weights))
        bundle = cls.build(kind, info["config"], state.pop("vocab_map"), info.get("meta"))
        bundle.module.load_state_dict({k.removeprefix("module."): v for k, v in state.items()})
        bundle.module.eval()
        bundle.version = info.get("version") or bundle.seal()
        return bundle

    @staticmethod
    def exists(directory: str | Path, kind: str) -> bool:
        directory = Path(directory)
        return (directory / f"{kind}.json").is_file() and (directory / f"{kind}.safetensors").is_file()
