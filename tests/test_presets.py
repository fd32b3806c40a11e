"""Preset loading: every shipped preset loads; bad keys and values are refused clearly."""

from __future__ import annotations

import sys

import pytest
from pydantic import BaseModel, ConfigDict

from policies import presets
from policies.base import PlanDraft, Policy
from policies.baselines import StaticConfig, StaticPolicy
from policies.presets import (
    PRESET_DIR,
    PresetError,
    build_policy,
    list_presets,
    load_preset,
    load_preset_text,
    register_policy,
    registered_policies,
)


@pytest.mark.parametrize("name", list_presets())
def test_every_shipped_preset_loads(name):
    policy = load_preset(name)
    assert isinstance(policy, Policy)
    assert policy.name == name  # the preset file is named after its policy
    assert load_preset(PRESET_DIR / f"{name}.yaml").config == policy.config


def test_every_shipped_preset_says_what_it_mirrors():
    for name in list_presets():
        assert (PRESET_DIR / f"{name}.yaml").read_text().startswith("#"), name


def test_bare_name_and_yaml_suffix_resolve_to_shipped_file():
    assert load_preset("trtllm-concurrency.yaml").config.draft_len_schedule == {4: 4, 8: 2, 32: 1}


def test_loads_a_preset_file_by_path(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("policy: static\ndepth: 5\nwidth: 2\n")
    policy = load_preset(path)
    assert isinstance(policy, StaticPolicy) and policy.config.decision().max_nodes == 10


def test_unknown_key_names_key_value_and_file(tmp_path):
    path = tmp_path / "typo.yaml"
    path.write_text("policy: trtllm-gate\nmax_draft_len: 4\nacceptance_rate_window_size: 8\n"
                    "acceptance_rate_threshold: 0.5\nacceptance_rate_windw: 16\n")
    with pytest.raises(PresetError) as err:
        load_preset(path)
    message = str(err.value)
    assert str(path) in message and "'acceptance_rate_windw'" in message and "16" in message
    assert "allowed keys:" in message and "acceptance_rate_window_size" in message
    assert "\n" not in message


def test_unknown_nested_key_is_named_by_its_path():
    with pytest.raises(PresetError, match=r"unknown key 'slots.8.foo' \(value 1\)$"):
        load_preset_text("policy: sglang-adaptive\nslots: {8: {candidate_steps: [0, 1], foo: 1}}\n", "s.yaml")


@pytest.mark.parametrize(
    "text, field, value",
    [
        ("policy: static\ndepth: 99\n", "depth", "99"),
        ("policy: trtllm-gate\nmax_draft_len: 4\nacceptance_rate_window_size: 0\nacceptance_rate_threshold: 1\n",
         "acceptance_rate_window_size", "0"),
        ("policy: sglang-adaptive\nema_alpha: 1.5\n", "ema_alpha", "1.5"),
        ("policy: sglang-adaptive\nslots: {8: {candidate_steps: [0, -1]}}\n", "slots.8.candidate_steps.1", "-1"),
        ("policy: vllm-batch-table\nnum_speculative_tokens_per_batch_size: [[1, 8, 99]]\n",
         "num_speculative_tokens_per_batch_size.0.2", "99"),
        ("policy: bandit-ucb\nexploration: -1\n", "exploration", "-1"),
        ("policy: static\ndepth: true\n", "depth", "True"),
    ],
)
def test_out_of_range_value_names_field_and_value(text, field, value):
    with pytest.raises(PresetError) as err:
        load_preset_text(text, source="given.yaml")
    message = str(err.value)
    assert message.startswith("given.yaml: invalid ")
    assert f"'{field}' = {value}:" in message
    assert "\n" not in message


def test_cross_field_check_names_its_fields():
    text = "policy: vllm-batch-table\nnum_speculative_tokens_per_batch_size: [[1, 16, 3], [10, 20, 1]]\n"
    with pytest.raises(PresetError, match=r"'num_speculative_tokens_per_batch_size' = .*overlaps"):
        load_preset_text(text, "x.yaml")
    text = "policy: trtllm-concurrency\nmax_draft_len: 4\nmax_concurrency: 8\ndraft_len_schedule: {4: 4}\n"
    with pytest.raises(PresetError, match="max_concurrency and draft_len_schedule are mutually exclusive"):
        load_preset_text(text, "x.yaml")


ISSUE_49548 = {"num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": [[1, 4, 2], [5, 512, 0]]}


def test_overrides_replace_the_files_fields_for_one_load():
    """A scenario's preset_config: laid over the file, validated with it, the file untouched."""
    shipped = load_preset("vllm-batch-table")
    policy = load_preset("vllm-batch-table", ISSUE_49548, "cliff.yaml: preset_config.vllm-batch-table")
    assert [shipped.config.k_for_batch(b) for b in (1, 4, 5, 8, 300)] == [3, 3, 3, 3, 0]
    assert [policy.config.k_for_batch(b) for b in (1, 4, 5, 8, 300)] == [2, 2, 0, 0, 0]
    assert load_preset("vllm-batch-table").config == shipped.config


@pytest.mark.parametrize(
    "overrides, expected",
    [
        ({"num_speculative_tokens": 0}, r"invalid 'vllm-batch-table' preset: 'num_speculative_tokens' = 0:"),
        ({"num_speculative_tokens_per_batch_size": [[2, 4, 2]]},
         r"'num_speculative_tokens_per_batch_size' = \[\[2, 4, 2\]\]: the first range must start at batch size 1"),
        ({"num_speculative_tokens_per_batch_sise": 2}, r"unknown key 'num_speculative_tokens_per_batch_sise' \(value 2\)"),
        ({"policy": "static"}, r"'policy' = 'static': overrides of .* cannot change its policy"),
    ],
)
def test_bad_override_names_where_it_came_from_the_field_and_the_value(overrides, expected):
    with pytest.raises(PresetError, match=expected) as err:
        load_preset("vllm-batch-table", overrides, "cliff.yaml: preset_config.vllm-batch-table")
    message = str(err.value)
    assert message.startswith("cliff.yaml: preset_config.vllm-batch-table")
    assert "vllm-batch-table.yaml" in message and "\n" not in message


def test_missing_required_key():
    with pytest.raises(PresetError, match="missing required key 'acceptance_rate_threshold'"):
        load_preset_text("policy: trtllm-gate\nacceptance_rate_window_size: 8\n", "g.yaml")


@pytest.mark.parametrize(
    "text, message",
    [
        ("depth: 3\n", "missing the 'policy:' key"),
        ("policy: nope\n", "unknown policy 'nope' (registered: "),
        ("policy: [static]\n", "'policy' must be a policy name string"),
        ("", "got empty"),
        ("- policy: static\n", "got a list"),
        ("policy: static\ndepth: [1\n", "not valid YAML"),
        ("policy: static\ndepth: 2\ndepth: 3\n", "not valid YAML at line 3, column 1: key 'depth' is given twice"),
    ],
)
def test_malformed_presets_are_refused(text, message):
    with pytest.raises(PresetError, match=message.replace("[", r"\[").replace("(", r"\(")):
        load_preset_text(text, "bad.yaml")


def test_unknown_preset_name_lists_available():
    with pytest.raises(PresetError, match="no shipped preset of that name.*static"):
        load_preset("no-such-preset")
    with pytest.raises(PresetError, match="no such preset file"):
        load_preset("some/dir/missing.yaml")


def test_preset_error_is_a_value_error():
    assert issubclass(PresetError, ValueError)


def test_string_batch_keys_as_in_engine_json_configs():
    text = 'policy: sglang-adaptive\nslots: {"1": {candidate_steps: [1, 3]}, "16": {candidate_steps: [0, 1]}}\n'
    policy = load_preset_text(text)
    assert policy.slot_keys == (1, 16)


def test_build_policy_from_fields():
    policy = build_policy("hf-heuristic", {"num_assistant_tokens": 7})
    assert policy.config.num_assistant_tokens == 7


# ================================================================================ registry


class _ToyConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    depth: int = 1


class _ToyPolicy(Policy[_ToyConfig]):
    name = "toy"

    def initial_state(self, seed: int = 0):
        return None

    def decide(self, state, obs):
        return PlanDraft(table=None), state  # pragma: no cover - never run


@pytest.fixture
def registry(monkeypatch):
    """A private copy of the registry so tests cannot leak registrations."""
    presets._load_policy_modules()
    monkeypatch.setattr(presets, "_REGISTRY", dict(presets._REGISTRY))
    return presets._REGISTRY


def test_register_policy_plugs_into_loader(registry):
    register_policy("toy", _ToyConfig, _ToyPolicy)
    policy = load_preset_text("policy: toy\ndepth: 4\n")
    assert isinstance(policy, _ToyPolicy) and policy.config.depth == 4
    assert "toy" in registered_policies()
    register_policy("toy", _ToyConfig, _ToyPolicy)  # same classes again: no-op


def test_register_policy_refuses_conflicts_and_loose_configs(registry):
    with pytest.raises(ValueError, match="already registered"):
        register_policy("static", _ToyConfig, _ToyPolicy)

    class Loose(BaseModel):
        depth: int = 1

    with pytest.raises(TypeError, match="extra='forbid'"):
        register_policy("loose", Loose, _ToyPolicy)
    with pytest.raises(TypeError, match="Policy subclass"):
        register_policy("bad", _ToyConfig, object)
    assert registry["static"].policy_cls is StaticPolicy and registry["static"].config_model is StaticConfig


def test_loader_works_when_goodput_module_is_absent(registry, monkeypatch):
    monkeypatch.delitem(registry, "goodput", raising=False)
    monkeypatch.setitem(sys.modules, "policies.goodput", None)  # import raises ModuleNotFoundError
    monkeypatch.setattr(presets, "_OPTIONAL_IMPORT_ERRORS", {})
    assert load_preset("static").name == "static"
    with pytest.raises(PresetError, match="unknown policy 'goodput'") as err:
        load_preset_text("policy: goodput\n")
    assert "failed to import" not in str(err.value)  # absent is not an error


def test_goodput_import_failure_is_reported_when_asked_for(registry, monkeypatch):
    monkeypatch.delitem(registry, "goodput", raising=False)
    monkeypatch.setattr(presets, "_OPTIONAL_IMPORT_ERRORS", {})
    monkeypatch.setattr(presets, "_OPTIONAL_POLICY_MODULES", ("policies._specctl_broken_for_test",))

    class Boom:  # a module that exists but whose own imports fail
        def find_spec(self, name, path=None, target=None):
            if name == "policies._specctl_broken_for_test":
                raise ImportError("cannot import name 'x' from 'scipy'")
            return None

    monkeypatch.setattr(sys, "meta_path", [Boom(), *sys.meta_path])
    with pytest.raises(PresetError, match="policies._specctl_broken_for_test failed to import: ImportError"):
        load_preset_text("policy: goodput\n")
    assert load_preset("static").name == "static"  # other presets still load
