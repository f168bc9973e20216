"""FSDP2 planning terms (sharding.py); the two-process measurement is in test_distributed.py."""
import warnings

import pytest
import torch
from torch import nn

import remat
from remat.planner import prepare
from remat.sharding import shard_bytes, unit_names


class WithRootParam(nn.Module):
    """A parameter read directly (get_attr) and a weight tied between two modules stay in the root."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(16))
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)
        self.c = nn.Linear(16, 16)
        self.c.weight = self.b.weight

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.a(x * self.scale)))))


def test_shards_pad_dim0_to_a_multiple_of_the_world_size():
    w = torch.empty(5, 3)
    assert shard_bytes(w, 1) == 60
    assert shard_bytes(w, 2) == 3 * 3 * 4  # rows 0-2 and 3-4 + one padding row
    assert shard_bytes(w, 8) == 1 * 3 * 4
    assert shard_bytes(torch.empty(()), 4) == 4


def test_units_are_called_modules_that_own_their_parameters():
    gm = remat.trace(WithRootParam(), (torch.randn(2, 16),))
    assert unit_names(gm) == ["a"]


def test_sharding_lowers_fixed_bytes_by_the_unit_shards():
    model, x = WithRootParam(), torch.randn(4, 16)
    plain = prepare(model, (x,))
    with pytest.warns(remat.RematWarning, match="whole at the root"):  # see the last test
        two = prepare(model, (x,), world_size=2, sharding="fsdp")
    a_bytes = sum(p.numel() * 4 for p in model.a.parameters())
    # a's gradient keeps half (16 rows -> 8 per rank); the root's parameters stay whole
    assert plain.fixed - plain.resident - (two.fixed - two.resident) == a_bytes // 2
    assert two.shard.grad_shards == {"a.weight": 8 * 16 * 4, "a.bias": 8 * 4}
    # the sharded simulation ends with the root gradients whole and a's as shards
    assert two.shard.grad_bytes(plain.profile.grad_bytes) == plain.profile.grad_bytes - a_bytes // 2


@pytest.mark.parametrize("kwargs, match", [
    ({"world_size": 2}, "sharding='fsdp'"),
    ({"world_size": 2, "sharding": "zero3"}, "unknown sharding"),
    ({"world_size": 0, "sharding": "fsdp"}, "positive int"),
])
def test_bad_sharding_arguments_raise_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        remat.checkpoint(WithRootParam(), (torch.randn(2, 16),), **kwargs)


def test_fully_shard_wants_the_generated_module():
    with pytest.raises(TypeError, match="GraphModule"):
        remat.fully_shard(nn.Linear(2, 2))


def test_warns_when_the_root_would_hold_most_parameters_whole():
    # WithRootParam's root (scale, the tied b/c weight, b's and c's biases) outweighs its one unit
    with pytest.warns(remat.RematWarning, match="whole at the root"):
        prepare(WithRootParam(), (torch.randn(2, 16),), world_size=2, sharding="fsdp")
    deep = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
    with warnings.catch_warnings():
        warnings.simplefilter("error", remat.RematWarning)
        prepare(deep, (torch.randn(2, 16),), world_size=2, sharding="fsdp")
