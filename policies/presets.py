"""Policy presets: a YAML file that names a policy and sets its fields.

A preset file names its policy under ``policy:`` and lists that policy's
configuration fields at top level (no nesting under a ``config:`` key)::

    # what this preset mirrors, in a comment
    policy: static
    depth: 3
    width: 1

A registry maps each policy name to its pydantic configuration model and its
:class:`~policies.base.Policy` class. Configuration models must forbid
unknown keys (``extra="forbid"``), so a typo or an out-of-range value is
refused with a :class:`PresetError` that names the file, the field and the
value, instead of silently running a different policy than the one written.

Policy modules register themselves on import with :func:`register_policy`.
The loader imports the baselines (:mod:`policies.baselines`) and, if present,
:mod:`policies.goodput` the first time it needs the registry.

>>> policy = load_preset_text("policy: static\\ndepth: 2\\n", source="inline")
>>> policy.name, policy.config.depth
('static', 2)
>>> try:
...     load_preset_text("policy: static\\ndepht: 2\\n", source="inline")
... except PresetError as err:
...     print(err)
inline: invalid 'static' preset: unknown key 'depht' (value 2); allowed keys: depth, width, max_nodes
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

import yaml
from pydantic import BaseModel, ValidationError

from policies.base import Policy
from policies.classes import parse_classes

PRESET_DIR: Path = Path(__file__).resolve().parent / "presets"
PRESET_SUFFIX = ".yaml"

# Policy modules imported before the registry is read. The baselines ship with
# this package; goodput is written separately and may not exist yet.
_BUILTIN_POLICY_MODULES: tuple[str, ...] = ("policies.baselines",)
_OPTIONAL_POLICY_MODULES: tuple[str, ...] = ("policies.goodput",)


class PresetError(ValueError):
    """A preset that cannot be loaded; the message names file, field and value."""


@dataclass(frozen=True, slots=True)
class PolicyEntry:
    """One registered policy: its preset name, config model and class."""

    name: str
    config_model: type[BaseModel]
    policy_cls: type[Policy]


_REGISTRY: dict[str, PolicyEntry] = {}
# module -> why it failed to import (quoted when its policy name is asked for).
_OPTIONAL_IMPORT_ERRORS: dict[str, str] = {}


def register_policy(name: str, config_model: type[BaseModel], policy_cls: type[Policy]) -> None:
    """Make ``policy: <name>`` in a preset build ``policy_cls(config_model(**fields))``.

    Parameters
    ----------
    name
        The preset name, e.g. ``"goodput"``.
    config_model
        A pydantic model with ``model_config["extra"] == "forbid"``.
    policy_cls
        A :class:`~policies.base.Policy` subclass taking that config.

    Raises
    ------
    TypeError
        If the classes do not fit the contract above.
    ValueError
        If ``name`` is already registered to different classes. Registering
        the same classes again (a module imported twice) is a no-op.
    """
    if not isinstance(name, str) or not name.strip():
        raise TypeError(f"policy name must be a non-empty string, got {name!r}")
    if not (isinstance(config_model, type) and issubclass(config_model, BaseModel)):
        raise TypeError(f"config_model for {name!r} must be a pydantic BaseModel subclass, got {config_model!r}")
    if config_model.model_config.get("extra") != "forbid":
        raise TypeError(
            f"config_model {config_model.__name__} for {name!r} must set model_config extra='forbid' "
            "so presets with unknown keys are refused"
        )
    if not (isinstance(policy_cls, type) and issubclass(policy_cls, Policy)):
        raise TypeError(f"policy_cls for {name!r} must be a Policy subclass, got {policy_cls!r}")
    entry = PolicyEntry(name, config_model, policy_cls)
    existing = _REGISTRY.get(name)
    if existing is not None and not _same_entry(existing, entry):
        raise ValueError(
            f"policy name {name!r} is already registered to "
            f"{_qualname(existing.policy_cls)} with {_qualname(existing.config_model)}"
        )
    _REGISTRY[name] = entry


def registered_policies() -> Mapping[str, PolicyEntry]:
    """All registered policies by name (read-only view, built-ins loaded)."""
    _load_policy_modules()
    return MappingProxyType(dict(sorted(_REGISTRY.items())))


def build_policy(name: str, fields: Mapping[str, Any], source: str = "<fields>") -> Policy:
    """Validate ``fields`` against policy ``name``'s config and build the policy.

    Raises
    ------
    PresetError
        Unknown policy name, unknown key, or a value the config refuses.
    """
    _load_policy_modules()
    entry = _REGISTRY.get(name)
    if entry is None:
        raise PresetError(f"{source}: {_unknown_policy_message(name)}")
    fields = dict(fields)
    # Request classes are every policy's (policies/classes.py), not one policy's config.
    try:
        classes = parse_classes(fields.pop("classes", None), fields.pop("default_class", None), source)
    except ValueError as exc:
        raise PresetError(str(exc)) from None
    try:
        config = entry.config_model.model_validate(fields)
    except ValidationError as exc:
        raise PresetError(_validation_message(exc, entry, source)) from None
    policy = entry.policy_cls(config)
    policy.classes = classes
    return policy


def load_preset_text(
    text: str,
    source: str = "<text>",
    overrides: Mapping[str, Any] | None = None,
    overrides_source: str = "overrides",
) -> Policy:
    """Build the policy a preset's YAML text describes.

    ``source`` names the text in error messages (a path, or ``"<text>"``).
    ``overrides``: fields that replace (or add to) the text's top-level
    fields before validation, e.g. a benchmark scenario's ``preset_config``
    for this preset; a whole field is replaced, nested mappings are not
    merged. They may not name ``policy``. The merged fields are validated as
    one preset, so a bad override is refused like a bad preset file, the
    message naming ``overrides_source`` as well as the file, the field and
    the value.
    """
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise PresetError(f"{source}: not valid YAML{_yaml_problem(exc)}") from None
    if not isinstance(data, dict):
        kind = "empty" if data is None else f"a {type(data).__name__}"
        raise PresetError(f"{source}: a preset must be a YAML mapping with a 'policy:' key, got {kind}")
    fields = dict(data)
    name = fields.pop("policy", None)
    if name is None:
        raise PresetError(
            f"{source}: missing the 'policy:' key naming the policy (one of: {', '.join(_known_names())})"
        )
    if not isinstance(name, str):
        raise PresetError(f"{source}: 'policy' must be a policy name string, got {_show(name)}")
    if overrides is not None:
        if not isinstance(overrides, Mapping):
            raise PresetError(
                f"{overrides_source}: overrides of {source} must be a mapping of field: value, "
                f"got {_show(overrides)}"
            )
        if "policy" in overrides:
            raise PresetError(
                f"{overrides_source}: 'policy' = {_show(overrides['policy'])}: overrides of {source} "
                f"cannot change its policy ({name!r}); name another preset instead"
            )
        fields.update(overrides)
        source = f"{overrides_source} over {source}"
    return build_policy(name, fields, source)


def load_preset(
    path_or_name: str | os.PathLike[str],
    overrides: Mapping[str, Any] | None = None,
    overrides_source: str = "overrides",
) -> Policy:
    """Build the policy of a preset file, given its path or a bare preset name.

    Parameters
    ----------
    path_or_name
        A path to a YAML preset, or a bare name such as ``"goodput"`` that
        resolves to ``policies/presets/goodput.yaml`` when no file of that
        name exists in the working directory.
    overrides, overrides_source
        Fields laid over the file's before validation, and what to call
        them in error messages (see :func:`load_preset_text`).

    Returns
    -------
    Policy
        The configured policy; its ``name`` and ``config`` say what it is.

    Raises
    ------
    PresetError
        No such file or preset, invalid YAML, unknown policy, unknown key or
        out-of-range value; the message names the file, field and value.
    """
    path = preset_path(path_or_name)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise PresetError(f"{path}: cannot read preset: {exc.strerror or exc}") from None
    return load_preset_text(text, source=str(path), overrides=overrides, overrides_source=overrides_source)


def preset_path(path_or_name: str | os.PathLike[str]) -> Path:
    """Where :func:`load_preset` reads ``path_or_name`` from."""
    given = Path(path_or_name)
    if given.is_file():
        return given
    shipped = PRESET_DIR / (given.name if given.suffix == PRESET_SUFFIX else given.name + PRESET_SUFFIX)
    if given.parent == Path(".") and shipped.is_file():
        return shipped
    raise PresetError(
        f"{os.fspath(path_or_name)}: no such preset file, and no shipped preset of that name "
        f"in {PRESET_DIR} (available: {', '.join(list_presets()) or 'none'})"
    )


def list_presets() -> list[str]:
    """Names of the presets shipped in ``policies/presets/`` (sorted)."""
    return sorted(p.stem for p in PRESET_DIR.glob(f"*{PRESET_SUFFIX}") if p.is_file())


# --------------------------------------------------------------------------- helpers


def _load_policy_modules() -> None:
    for module in _BUILTIN_POLICY_MODULES:
        importlib.import_module(module)
    for module in _OPTIONAL_POLICY_MODULES:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            # Absent module: its policy is simply not offered. A module that
            # exists but fails to import is remembered and quoted when its
            # policy name is asked for, so the cause is not hidden.
            if not (isinstance(exc, ModuleNotFoundError) and exc.name == module):
                _OPTIONAL_IMPORT_ERRORS[module] = _one_line(f"{type(exc).__name__}: {exc}")
        else:
            _OPTIONAL_IMPORT_ERRORS.pop(module, None)


def _known_names() -> list[str]:
    return sorted(_REGISTRY)


def _unknown_policy_message(name: str) -> str:
    message = f"unknown policy {name!r} (registered: {', '.join(_known_names()) or 'none'})"
    failed = [f"{module} failed to import: {why}" for module, why in sorted(_OPTIONAL_IMPORT_ERRORS.items())]
    return message + ("; " + "; ".join(failed) if failed else "")


def _validation_message(exc: ValidationError, entry: PolicyEntry, source: str) -> str:
    problems: list[str] = []
    unknown_top_level_key = False
    for err in exc.errors(include_url=False):
        loc = ".".join(str(part) for part in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            unknown_top_level_key |= len(err["loc"]) == 1
            problems.append(f"unknown key {loc!r} (value {_show(err.get('input'))})")
        elif err["type"] == "missing":
            problems.append(f"missing required key {loc!r}")
        elif loc:
            problems.append(f"{loc!r} = {_show(err.get('input'))}: {msg}")
        else:  # a check across fields: its message names them
            problems.append(msg)
    text = f"{source}: invalid {entry.name!r} preset: " + "; ".join(problems)
    if unknown_top_level_key:
        text += "; allowed keys: " + ", ".join(entry.config_model.model_fields)
    return _one_line(text)


def _yaml_problem(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None)
    if mark is None or problem is None:
        return ": " + _one_line(str(exc))
    where = f" at line {mark.line + 1}, column {mark.column + 1}"
    context = getattr(exc, "context", None)
    return f"{where}: {_one_line(problem)}" + (f" ({_one_line(context)})" if context else "")


def _show(value: Any, limit: int = 80) -> str:
    text = repr(value) if isinstance(value, str) else str(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _same_entry(a: PolicyEntry, b: PolicyEntry) -> bool:
    # Compare by qualified name: a module imported twice (e.g. by pytest's
    # importlib mode) yields new class objects for the same definitions.
    return (_qualname(a.config_model), _qualname(a.policy_cls)) == (
        _qualname(b.config_model),
        _qualname(b.policy_cls),
    )


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice (YAML would keep the last)."""


def _construct_unique_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    loader.flatten_mapping(node)
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        try:
            hash(key)
        except TypeError:
            continue  # construct_mapping reports unhashable keys itself
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"key {key!r} is given twice", key_node.start_mark
            )
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_unique_mapping)


__all__ = (
    "PRESET_DIR",
    "PolicyEntry",
    "PresetError",
    "build_policy",
    "list_presets",
    "load_preset",
    "load_preset_text",
    "preset_path",
    "register_policy",
    "registered_policies",
)
