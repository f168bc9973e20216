"""Helpers the tests and benchmarks share: one training step compared with the original model's,
random DAG networks for fuzzing, and small models with the patterns that broke remat elsewhere
(``remat.testing.patterns``).  Public so that users can check their own models the same way:
``remat.testing.assert_same_step(model, lambda m: remat.checkpoint(m, inputs), inputs)``."""
from .fuzz import ALL_OPS, INPLACE_OPS, OPS, FuzzNet, Spec, random_spec
from .step import assert_predicted, assert_same_step, train_step

__all__ = ["ALL_OPS", "INPLACE_OPS", "OPS", "FuzzNet", "Spec", "assert_predicted", "assert_same_step", "random_spec", "train_step"]
