"""Drafters behind one Protocol (``worker.reference.drafters.base.Drafter``)."""

from worker.reference.drafters.base import DraftContext, Drafter, DrafterLimits, DraftTree

__all__ = ["DraftContext", "DraftTree", "Drafter", "DrafterLimits"]
