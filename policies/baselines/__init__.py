"""Baselines: policies that behave exactly like today's engines (docs/design.md §4).

Each policy mirrors one engine's run-time adaptation rule, read from the
engine's source, so a benchmark compares the controller against what an
operator can switch on today:

======================  =========================================================
preset name             engine setting mirrored
======================  =========================================================
``static``              fixed depth/width (vLLM ``num_speculative_tokens``,
                        SGLang ``--speculative-num-steps``, TRT-LLM ``max_draft_len``)
``vllm-batch-table``    vLLM V1 ``num_speculative_tokens_per_batch_size`` (PR 32374)
``trtllm-concurrency``  TensorRT-LLM ``max_concurrency`` / ``draft_len_schedule``
``trtllm-gate``         TensorRT-LLM ``acceptance_rate_window_size`` +
                        ``acceptance_rate_threshold`` (permanent off-gate)
``sglang-adaptive``     SGLang ``--speculative-adaptive`` (PR 21599)
``hf-heuristic``        HF transformers ``num_assistant_tokens_schedule="heuristic"``
``bandit-ucb``          BanditSpec (ICML'25) UCB over the draft length γ
======================  =========================================================

Words as in :mod:`policies.table`: depth ``d`` = draft tokens along a chain
(0 = speculation off), width ``w`` = candidates per level (1 = chain),
accepted ``τ`` = draft tokens accepted in a step, bonus token excluded.
All engine baselines draft chains except ``static``, which may set a width.

Policy state is a frozen dataclass (or a tuple of them) holding only tuples,
so ``decide`` cannot change the state it is given; it returns a new one.
Constants derived from a config (e.g. SGLang's resolved slots) may live on
the policy object; run-time memory never does.

One module per policy, named for it (``vllm-batch-table`` lives in
:mod:`policies.baselines.vllm_batch_table`, and so on); the field bounds,
:class:`StrictConfig` and :func:`chain_table` they share are in
:mod:`policies.baselines.base`. Importing this package registers every
policy above under its preset name (:func:`policies.presets.register_policy`).
"""

from __future__ import annotations

from typing import Mapping

from policies.base import Policy
from policies.baselines.bandit_ucb import BanditState, BanditUcbConfig, BanditUcbPolicy, round_reward, ucb_choose
from policies.baselines.base import (
    MAX_BATCH,
    MAX_DRAFT,
    BatchKey,
    BatchSize,
    DraftLen,
    PositiveDraftLen,
    StrictConfig,
    chain_table,
)
from policies.baselines.hf_heuristic import HfHeuristicConfig, HfHeuristicPolicy, HfState, hf_next
from policies.baselines.sglang_adaptive import (
    SglangAdaptiveConfig,
    SglangAdaptivePolicy,
    SglangSlotConfig,
    SlotParams,
    SlotState,
    slot_observe,
    slot_redecide,
    slot_start,
)
from policies.baselines.static import StaticConfig, StaticPolicy
from policies.baselines.trtllm_concurrency import TrtllmConcurrencyConfig, TrtllmConcurrencyPolicy
from policies.baselines.trtllm_gate import GateState, TrtllmGateConfig, TrtllmGatePolicy, gate_record
from policies.baselines.vllm_batch_table import BatchRange, VllmBatchTableConfig, VllmBatchTablePolicy
from policies.presets import register_policy

__all__ = [
    "BASELINES",
    "MAX_BATCH",
    "MAX_DRAFT",
    "BanditState",
    "BanditUcbConfig",
    "BanditUcbPolicy",
    "BatchKey",
    "BatchRange",
    "BatchSize",
    "DraftLen",
    "GateState",
    "HfHeuristicConfig",
    "HfHeuristicPolicy",
    "HfState",
    "PositiveDraftLen",
    "SglangAdaptiveConfig",
    "SglangAdaptivePolicy",
    "SglangSlotConfig",
    "SlotParams",
    "SlotState",
    "StaticConfig",
    "StaticPolicy",
    "StrictConfig",
    "TrtllmConcurrencyConfig",
    "TrtllmConcurrencyPolicy",
    "TrtllmGateConfig",
    "TrtllmGatePolicy",
    "VllmBatchTableConfig",
    "VllmBatchTablePolicy",
    "chain_table",
    "gate_record",
    "hf_next",
    "round_reward",
    "slot_observe",
    "slot_redecide",
    "slot_start",
    "ucb_choose",
]

BASELINES: Mapping[str, tuple[type[StrictConfig], type[Policy]]] = {
    StaticPolicy.name: (StaticConfig, StaticPolicy),
    VllmBatchTablePolicy.name: (VllmBatchTableConfig, VllmBatchTablePolicy),
    TrtllmConcurrencyPolicy.name: (TrtllmConcurrencyConfig, TrtllmConcurrencyPolicy),
    TrtllmGatePolicy.name: (TrtllmGateConfig, TrtllmGatePolicy),
    SglangAdaptivePolicy.name: (SglangAdaptiveConfig, SglangAdaptivePolicy),
    HfHeuristicPolicy.name: (HfHeuristicConfig, HfHeuristicPolicy),
    BanditUcbPolicy.name: (BanditUcbConfig, BanditUcbPolicy),
}

for _name, (_config, _policy) in BASELINES.items():
    register_policy(_name, _config, _policy)
