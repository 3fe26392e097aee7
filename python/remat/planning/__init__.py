"""Planning: what a training step holds and what fits, below ``remat.patch`` and above
remat.replacement.

- :mod:`remat.planning.estimator`: the full simulation of a step on fake tensors (the reference).
- :mod:`remat.planning.composed`: ``remat.estimate``, the same answer composed from a few layers and
  tiles in seconds.
- :mod:`remat.planning.model_plan`: ``policy="auto"`` on example inputs (per-layer policies and
  checkpointed spans under a budget).
- :mod:`remat.planning.peak_plan`: ``policy="auto"`` at a length (the step's device peak).
- :mod:`remat.planning.fit`: ``python -m remat fit``, the longest step that fits a GPU per setup.

The package imports nothing itself: each module is imported where it is used.
"""
