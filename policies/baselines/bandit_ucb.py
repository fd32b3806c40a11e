"""``bandit-ucb``: BanditSpec (ICML'25) UCB over the draft length γ."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from pydantic import Field, field_validator

from policies.base import Observation, PlanDraft, Policy, uniform_plan
from policies.baselines.base import PositiveDraftLen, StrictConfig
from policies.table import Decision


class BanditUcbConfig(StrictConfig):
    """Arms and exploration constant of the UCB bandit."""

    arms: tuple[PositiveDraftLen, ...] = Field(
        (1, 2, 3, 4), min_length=1, description="draft lengths γ to choose from"
    )
    exploration: float = Field(1.0, ge=0.0, le=100.0, description="c in mean + c sqrt(2 ln N / n_a)")

    @field_validator("arms")
    @classmethod
    def _unique(cls, arms: tuple[int, ...]) -> tuple[int, ...]:
        if len(set(arms)) != len(arms):
            raise ValueError(f"arms must be distinct, got {list(arms)}")
        return arms


@dataclass(frozen=True, slots=True)
class BanditState:
    """Pull counts and raw reward sums per arm, the largest reward seen, and the arm in force."""

    counts: tuple[int, ...]
    sums: tuple[float, ...]
    max_reward: float = 0.0
    current: int | None = None  # index into arms; None before the first decide


def round_reward(obs: Observation) -> float | None:
    """Tokens per second of the round: Σ emitted tokens / Σ step seconds (None if no time)."""
    seconds = sum(step.step_ms for step in obs.steps) / 1000.0
    if seconds <= 0.0:
        return None
    return sum(step.tokens for step in obs.steps) / seconds


def ucb_choose(state: BanditState, exploration: float) -> int:
    """Index of the next arm: unplayed arms first in order, then UCB1 (ties: lowest index)."""
    for i, n in enumerate(state.counts):
        if n == 0:
            return i
    total = sum(state.counts)
    scale = state.max_reward or 1.0

    def index(i: int) -> float:
        mean = state.sums[i] / state.counts[i] / scale
        return mean + exploration * math.sqrt(2.0 * math.log(total) / state.counts[i])

    return max(range(len(state.counts)), key=lambda i: (index(i), -i))


class BanditUcbPolicy(Policy[BanditUcbConfig]):
    """BanditSpec (ICML'25) UCB over the draft length γ ∈ {1, 2, 3, 4}.

    Rule: a round is the steps of one ``decide`` call (``obs.steps``); its
    reward is the tokens per second they achieved, Σ(τ + 1) / Σ step seconds,
    credited to the arm chosen at the previous call (a round without steps
    or time credits nothing). Warm-up plays every arm once, round-robin in
    the configured order; afterwards the arm maximising
    ``mean_a / r_max + c * sqrt(2 ln N / n_a)`` is played (UCB1 with
    ``c = 1``), where ``r_max`` is the largest round reward seen so far.
    Dividing by that running maximum puts the means in [0, 1], the range
    UCB1's exploration term is calibrated for, whatever the model's speed;
    raw sums are kept so the normalisation always uses the latest maximum.
    The chosen γ applies worker-wide: a uniform chain table, no overrides.
    Steps run under a plan the worker had not yet applied are credited to
    the new arm all the same, as in the paper's round model.
    """

    name = "bandit-ucb"

    def initial_state(self, seed: int = 0) -> BanditState:
        n = len(self.config.arms)
        return BanditState((0,) * n, (0.0,) * n)

    def decide(self, state: BanditState, obs: Observation) -> tuple[PlanDraft, BanditState]:
        reward = round_reward(obs) if state.current is not None else None
        if reward is not None:
            i = state.current
            state = replace(
                state,
                counts=_bump(state.counts, i, 1),
                sums=_bump(state.sums, i, reward),
                max_reward=max(state.max_reward, reward),
            )
        arm = ucb_choose(state, self.config.exploration)
        table = uniform_plan(Decision.chain(self.config.arms[arm]), obs)
        return PlanDraft(table), replace(state, current=arm)


def _bump(values: tuple, i: int, amount: float) -> tuple:
    return values[:i] + (values[i] + amount,) + values[i + 1 :]
