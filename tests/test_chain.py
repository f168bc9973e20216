"""Linearization (chain.py): stages no skip connection crosses, in-place consumers with producers."""
import pytest
import torch

from models import traced_chain as _chain

torchvision = pytest.importorskip("torchvision")


def _assert_no_skip_crosses(gm, chain):
    """Every value a stage reads from an earlier stage is that stage's output or a common value."""
    nodes = list(gm.graph.nodes)
    stage_of = {}
    for s in chain.stages:
        for i in range(s.first, s.last + 1):
            stage_of[nodes[i]] = s.index
    outputs = {nodes[s.last] for s in chain.stages}
    for node, s in stage_of.items():
        for inp in node._input_nodes:
            prof = inp.meta["remat"]
            if inp.op in ("get_attr", "placeholder") or not prof.tensor_out or inp not in stage_of:
                continue
            if stage_of[inp] != s:
                assert inp in outputs and stage_of[inp] == s - 1, f"{inp.name} crosses into stage {s}"


@pytest.mark.slow
def test_resnet50_stages_never_split_a_residual_block():
    model = torchvision.models.resnet50()
    gm, chain = _chain(model, (torch.randn(1, 3, 64, 64),))
    assert len(chain) >= 10
    _assert_no_skip_crosses(gm, chain)
    for layer in range(1, 5):
        for block in range(len(getattr(model, f"layer{layer}"))):
            prefix = f"layer{layer}_{block}_"
            stages = {s.index for s in chain.stages for n in s.nodes if n.startswith(prefix)}
            assert len(stages) == 1, f"block {prefix} split over stages {stages}"


@pytest.mark.slow
def test_vit_b_16_linearizes_into_many_stages():
    gm, chain = _chain(torchvision.models.vit_b_16(), (torch.randn(1, 3, 224, 224),))
    assert len(chain) >= 10
    _assert_no_skip_crosses(gm, chain)
    # the residual adds of each encoder block: the skip input is defined in the same stage
    for s in chain.stages:
        for name in s.nodes:
            if name.startswith("add"):
                assert s.index > 0


def test_inplace_consumer_stays_with_its_producer():
    gm, chain = _chain(torchvision.models.resnet18(), (torch.randn(1, 3, 64, 64),))
    stage_of = {n: s.index for s in chain.stages for n in s.nodes}
    assert stage_of["bn1"] == stage_of["relu"]  # relu is ReLU(inplace=True)
