"""What the controller learns per worker and drafter version: the step-cost
model (:mod:`controller.models.cost`) and the acceptance model
(:mod:`controller.models.acceptance`)."""
