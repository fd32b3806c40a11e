"""Settings of head training, importable without torch (the CLI builds its
options from them)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["DEFAULT_DATA", "GEN_BATCH", "KINDS", "DistillData", "TrainConfig"]

KINDS = ("medusa", "eagle")

# Rows the target answers at once while it builds distillation data. On one CPU thread here the tuned kernels
# stream each weight once for many rows: 48 prompts sampled at batch 8 ran at 47-51 tok/cpu-s, at batch 48 at
# 109-112 (two interleaved rounds on SmolLM2, issue #4). The data does not depend on it beyond float rounding and the sampler's draws.
GEN_BATCH = 48


@dataclass(frozen=True)
class DistillData:
    """What the target answers for self-distillation: the prompt set, the
    answer length and how many sampled answers per training prompt."""

    prompts: str = "all"
    max_new_tokens: int = 128
    samples: int = 2
    temperature: float = 0.8


# The data first use trains each kind on (``ensure_heads``). EAGLE keeps gaining from more sampled answers
# to the same prompts, Medusa does not (SmolLM2-135M, 31 held-out prompts, issue #4): EAGLE's held-out greedy
# chain tau(d2) / tau(d4) 0.58 / 0.65 with 1 sampled answer, 0.63 / 0.74 with 2, 0.70 / 0.86 with 5, 0.77 / 0.96
# with 10 (each further answer ~5 min of one core's generation; EAGLE's training grows with the data); Medusa
# 0.47 / 0.56 with 1 and 2.
DEFAULT_DATA = {"medusa": DistillData(samples=2), "eagle": DistillData(samples=10)}


@dataclass
class TrainConfig:
    """Optimisation and loss settings of ``worker.reference.heads.train.train``."""

    kind: str = "eagle"
    epochs: int = 6
    lr: float = 2e-3
    weight_decay: float = 0.0  # AdamW's decoupled decay
    batch_positions: int = 512  # medusa: positions per step
    batch_sequences: int = 8  # eagle: sequences per step
    draft_vocab: int = 8192  # 0 = full vocabulary
    num_heads: int = 4  # medusa heads / eagle report depth
    held_out: float = 0.1
    seed: int = 0
    # eagle: held-out sweep on SmolLM2-135M (issue #4): noise 0.15 with reg_weight 1.0 gave a greedy chain
    # tau(d2) of 0.583 against 0.555 for noise 0.05 / reg_weight 0.1, at the same training cost
    noise: float = 0.15  # eagle: input-feature noise, relative to the feature RMS
    unroll: int = 2  # eagle: training passes on its own predictions
    cls_weight: float = 1.0  # eagle: weight of the token loss
    reg_weight: float = 1.0  # eagle: weight of the feature (smooth-L1) loss
    loss_on: str = "all"  # "all" positions or only the "answer" (from the last prompt token on)
    init_from_target: bool = False  # eagle: warm-start the layer from the target's last layer (worse here)
    topk: int = 5  # report: top-k accuracy
    extra: dict = field(default_factory=dict)
