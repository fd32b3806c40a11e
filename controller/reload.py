"""Hot reload of the policy file: on change (polled mtime) or on SIGHUP.

A file that fails to load is refused and logged, and the policy in force
stays in force.
"""

from __future__ import annotations

import logging
import os

from controller.core import Controller
from policies.presets import PresetError, load_preset, preset_path

log = logging.getLogger("specctl.reload")


class PolicySource:
    """The policy file a controller follows."""

    def __init__(self, controller: Controller, spec: str) -> None:
        self.controller = controller
        self.path = preset_path(spec)
        self._signature = self._stat()
        self.last_error = ""

    def _stat(self) -> tuple[float, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_mtime, st.st_size)

    def poll(self) -> bool:
        """Reload if the file changed since the last look; True if reloaded."""
        signature = self._stat()
        if signature == self._signature:
            return False
        self._signature = signature
        return self.reload()

    def reload(self) -> bool:
        try:
            policy = load_preset(self.path)
        except (PresetError, OSError) as err:
            self.controller.policy_reload_failures += 1
            self.last_error = str(err)
            log.error("policy file refused, keeping %s in force: %s", self.controller.policy.name, err)
            return False
        self.controller.set_policy(policy)
        self.last_error = ""
        log.info("policy reloaded from %s: %s", self.path, policy.name)
        return True
