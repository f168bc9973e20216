"""Rules that hold on every device: what fake kernels return that real ones do not, hidden writes."""
from __future__ import annotations

from typing import Any

import torch

from .registry import rule

aten = torch.ops.aten


def _bn_backward_dropped(args: tuple, out: Any) -> Any:
    # args[9] is the output mask (grad_input, grad_weight, grad_bias)
    if len(args) > 9 and not args[9][0]:
        return out[1:]
    return out


rule(aten.native_batch_norm_backward.default, "*",
     "a grad_input the output mask drops is not allocated (the fake kernel allocates it anyway)",
     "derived: ATen's batch_norm_backward returns an undefined grad_input when output_mask[0] is False",
     dropped=_bn_backward_dropped)

rule([aten.native_batch_norm.default, aten._batch_norm_with_update.default, aten._native_batch_norm_legit.default],
     "*", "writes the running mean and variance (arguments 3, 4) in training",
     "derived: the ops' documentation; their schemas do not mark these arguments as written",
     writes=(3, 4))
