"""What a recipe minimizes besides next-token cross-entropy, each its paper's formula, with the step that computes
it: preference losses (:mod:`~toolkit.objectives.preference`: DPO, IPO, SimPO, ORPO, with their references), KTO
(:mod:`~toolkit.objectives.kto`) and distillation (:mod:`~toolkit.objectives.distillation`); online RL's go here
next.

Supervised fine-tuning's objective is the step itself (:func:`toolkit.training.forward_backward`): the token sums
of :mod:`toolkit.modules.loss` (fused with the output projection, so model blocks) over the global batch's token
count (:mod:`toolkit.training.accumulation`). The objectives here build on that step and sit above it.
"""
