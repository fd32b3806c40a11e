"""Drafters behind one Protocol (``worker.drafters.base.Drafter``)."""

from worker.drafters.base import DraftContext, Drafter, DrafterLimits, DraftTree

__all__ = ["DraftContext", "DraftTree", "Drafter", "DrafterLimits"]
