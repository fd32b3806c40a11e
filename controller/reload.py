"""Hot reload of the policy file: on change (polled mtime) or on SIGHUP.

A file that fails to load is refused and logged, and the policy in force
stays in force. A reload that is accepted is handed to ``on_reload`` hooks
with the exact text that was validated: a replica sharing state through
Redis publishes it to the other replicas (:mod:`controller.fleet.bus`), so a
bad file never leaves the replica that read it.
"""

from __future__ import annotations

import logging
import os
from typing import Callable

from controller.core import Controller
from policies.presets import PresetError, load_preset_text, preset_path

log = logging.getLogger("specctl.reload")


class PolicySource:
    """The policy file a controller follows.

    Attributes
    ----------
    on_reload : list of callables
        ``hook(text, source)`` after each accepted reload, with the text
        that was validated and put in force and the file's name.
    """

    def __init__(self, controller: Controller, spec: str) -> None:
        self.controller = controller
        self.path = preset_path(spec)
        self._signature = self._stat()
        self.last_error = ""
        self.on_reload: list[Callable[[str, str], None]] = []

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
            # Read once and validate that text: what is published is exactly what was accepted,
            # even if the file changes again between the two.
            text = self.path.read_text(encoding="utf-8")
            policy = load_preset_text(text, source=str(self.path))
        except OSError as err:
            return self._refuse(PresetError(f"{self.path}: cannot read preset: {err.strerror or err}"))
        except PresetError as err:
            return self._refuse(err)
        self.controller.set_policy(policy)
        self.last_error = ""
        log.info("policy reloaded from %s: %s", self.path, policy.name)
        for hook in self.on_reload:
            try:
                hook(text, self.path.name)
            except Exception:  # noqa: BLE001 - the reload is done; a hook's fault must not undo or hide it
                log.exception("policy reload hook failed")
        return True

    def _refuse(self, err: Exception) -> bool:
        self.controller.policy_reload_failures += 1
        self.last_error = str(err)
        log.error("policy file refused, keeping %s in force: %s", self.controller.policy.name, err)
        return False
