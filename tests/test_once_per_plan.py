"""What a plan needs once is worked out once: the class tail scales of one observation
(shared by the policy's solve and the controller's plan judge) and the per-class masks of
a multi-class batch (shared by every row the solve prices)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

import policies.goodput as goodput
from policies.goodput import class_plan_estimate, class_tail_scale, class_tail_scales
from tests.test_goodput_classes import policy, target_case


def tail_case():
    """Two classes, the interactive one with a p99 target whose slowest requests accept a
    fifth of its mean draft tokens: its tail scale is not 1 (an expansion to compute)."""
    obs = target_case(7.0)
    tail_load = replace(obs.class_load["interactive"], tail_tokens_per_step=1.2, tpot_ms_p99=6.0)
    return replace(obs, class_load={**obs.class_load, "interactive": tail_load})


def test_one_observations_class_tail_scales_are_computed_once_for_the_plan_and_its_judge(monkeypatch):
    obs = tail_case()
    calls = []
    real = goodput.class_tail_scale
    monkeypatch.setattr(goodput, "class_tail_scale", lambda o, rc, *rest: calls.append(rc.name) or real(o, rc, *rest))
    pol = policy()
    plan, _ = pol.decide(pol.initial_state(), obs)
    older, _ = policy(min_gain=0.5).decide(pol.initial_state(), obs)
    for batch in (8.0, 256.0):  # the controller's judge: both plans at two batches, the same observation
        class_plan_estimate(plan, obs, batch).better_than(class_plan_estimate(older, obs, batch))
    assert sorted(calls) == sorted(rc.name for rc in obs.classes)  # once per class, not once per reader
    scales = class_tail_scales(obs)
    _, context_share, _ = goodput.class_mix(obs)
    assert scales.tolist() == [class_tail_scale(obs, rc, k, context_share) for k, rc in enumerate(obs.classes)]
    assert scales[0] != 1.0 and scales[1] == 1.0  # the p99 class's tail, the best-effort class's none
    assert not scales.flags.writeable  # shared: nobody may change it under the others


def test_a_new_observation_gets_its_own_tail_scales(monkeypatch):
    """An observation is a snapshot: another one (even equal in every field) is computed afresh,
    and one whose class load differs gets its own scale."""
    obs = tail_case()
    first = class_tail_scales(obs)
    calls = []
    real = goodput.class_tail_scale
    monkeypatch.setattr(goodput, "class_tail_scale", lambda o, rc, *rest: calls.append(rc.name) or real(o, rc, *rest))
    assert class_tail_scales(replace(obs)).tolist() == first.tolist()
    assert len(calls) == len(obs.classes)
    deeper_tail = replace(obs.class_load["interactive"], tail_tokens_per_step=1.6)
    other = replace(obs, class_load={**obs.class_load, "interactive": deeper_tail})
    assert class_tail_scales(other)[0] > first[0]  # slowest requests nearer the mean: a scale nearer 1


def test_a_class_batch_holds_each_classes_groups_once():
    cb = policy().class_batch(tail_case())
    assert len(cb.groups) > len(cb.classes) - 1
    for k in range(len(cb.classes)):
        assert [g for g, held in zip(cb.groups, cb.class_masks[k]) if held] == [g for g in cb.groups if g[0] == k]
        assert cb.member[:, k].tolist() == cb.class_masks[k].astype(float).tolist()
    assert cb.member.sum(axis=1) == pytest.approx(np.ones(len(cb.groups)))
