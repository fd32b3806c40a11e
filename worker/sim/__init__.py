"""Simulated GPU workers for specctl.

- :mod:`worker.sim.hardware`: roofline step costs (target verify, EAGLE/Medusa drafting);
- :mod:`worker.sim.acceptance`: ground-truth acceptance ``q[k, r]`` (context decay, drift, optional correlated spans);
- :mod:`worker.sim.tree`: EAGLE-2-style greedy trees and sampled verification outcomes;
- :mod:`worker.sim.scenario`: validated YAML scenarios (``worker/sim/scenarios``);
- :mod:`worker.sim.traffic`: seeded arrivals independent of decisions;
- :mod:`worker.sim.worker`: :class:`SimWorker`, a clock-agnostic continuous-batching engine;
- :mod:`worker.sim.runner`: simulated-time and real-time drivers.
"""

from policies.chain import expected_chain_accepted
from worker.sim.acceptance import PROFILES as ACCEPTANCE_PROFILES
from worker.sim.acceptance import AcceptanceProfile, AcceptanceTruth
from worker.sim.hardware import HARDWARE_PROFILES, MODEL_PROFILES, CostModel, HardwareProfile, ModelProfile
from worker.sim.runner import RunResult, run_fleet_simulated, run_realtime, run_simulated
from worker.sim.scenario import Scenario, ScenarioError, load_scenario, scenario_from_dict, shipped_scenarios
from worker.sim.worker import HelloInfo, SimWorker, StepResult, WorkerStats

__all__ = [
    "ACCEPTANCE_PROFILES",
    "AcceptanceProfile",
    "AcceptanceTruth",
    "CostModel",
    "HARDWARE_PROFILES",
    "HardwareProfile",
    "HelloInfo",
    "MODEL_PROFILES",
    "ModelProfile",
    "RunResult",
    "Scenario",
    "ScenarioError",
    "SimWorker",
    "StepResult",
    "WorkerStats",
    "expected_chain_accepted",
    "load_scenario",
    "run_fleet_simulated",
    "run_realtime",
    "run_simulated",
    "scenario_from_dict",
    "shipped_scenarios",
]
