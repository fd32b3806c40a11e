"""``specctl serve --config FILE``: tell a policy file given there from a broken server config.

A policy preset (``policy: goodput`` plus that policy's fields) passed to
``--config`` fails server-config validation with "Extra inputs are not
permitted" for every policy field, which does not say what went wrong.
:func:`policy_file_mistake` recognises that case so ``serve`` can say
``use --policy FILE`` instead. It is only asked once the file was refused as
a server config, so a valid config is never second-guessed.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from controller.config import ServerConfig
from policies.presets import PresetError, load_preset, registered_policies


def policy_file_mistake(path: str | Path) -> str | None:
    """A one-line message when ``path`` is a policy file rather than a server config, else ``None``.

    The file counts as a policy file when it has a ``policy:`` key and none
    of its other top-level keys is a server-config field, and either it loads
    as a policy preset or ``policy:`` names a registered policy and some of
    its keys are that policy's fields (a preset with a typo in it). A server
    config with a misspelt key (``policy: goodput`` and ``lisen: ...``) is
    not one: its keys are no policy's fields.
    """
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    if not isinstance(data, dict) or "policy" not in data:
        return None
    others = set(data) - {"policy"}
    if not others or others & set(ServerConfig.model_fields):
        return None
    name = data["policy"]
    try:
        load_preset(path)
        loads = True
    except PresetError:
        loads = False
    if not loads:
        entry = registered_policies().get(name) if isinstance(name, str) else None
        if entry is None or not others & set(entry.config_model.model_fields):
            return None
    return (f"{path} is a policy file (policy: {name}), not a server config; "
            f"use `specctl serve --policy {path}` instead (--config takes the controller's settings: "
            f"listen, policy, plan, metrics_listen, ...)")
