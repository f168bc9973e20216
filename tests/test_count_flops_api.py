"""count_flops accepts real, meta and fake inputs, allocates nothing real and never touches the model."""
import pytest
import torch

import remat

torchvision = pytest.importorskip("torchvision")


def _snapshot(model):
    return {k: (v.data_ptr(), v.clone()) for k, v in model.state_dict().items()}


def _assert_unchanged(model, snap):
    for k, v in model.state_dict().items():
        ptr, value = snap[k]
        assert v.data_ptr() == ptr, k
        assert torch.equal(v, value), k
    assert all(p.grad is None for p in model.parameters())


def _conv_linear_macs(model: torch.nn.Module, x: torch.Tensor) -> int:
    """An independent count: multiply-adds of every Conv2d and Linear from the layer shapes and
    their output sizes (forward hooks on a meta run), without any aten-level formula."""
    total = 0

    def hook(module, inputs, out):
        nonlocal total
        if isinstance(module, torch.nn.Conv2d):
            per_output = module.in_channels // module.groups * module.kernel_size[0] * module.kernel_size[1]
            total += out.numel() * per_output
        elif isinstance(module, torch.nn.Linear):
            total += out.numel() * module.in_features

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear))]
    with torch.no_grad():
        model.to("meta")(x)
    for h in handles:
        h.remove()
    return total


def test_meta_input_real_model_big_batch_is_not_allocated():
    model = torchvision.models.resnet50()
    snap = _snapshot(model)
    x = torch.rand(4000, 3, 224, 224, device="meta")  # ~2.4 GB if it were real
    c = remat.count_flops(model, (x,))
    _assert_unchanged(model, snap)
    assert c.fwd_macs == _conv_linear_macs(torchvision.models.resnet50(), x)


def test_model_on_meta_and_fake_inputs_agree_with_real():
    model = torchvision.models.resnet18()
    x = torch.randn(2, 3, 64, 64)
    real = remat.count_flops(model, (x,))
    meta_model = torchvision.models.resnet18().to("meta")
    assert remat.count_flops(meta_model, (x.to("meta"),)) == real
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fx = mode.from_tensor(x)
    assert remat.count_flops(model, (fx,)) == real


def test_bound_method_and_kwargs():
    layer = torch.nn.Linear(8, 4)
    x = torch.randn(3, 8)
    c = remat.count_flops(layer.forward, (x,))
    assert c.fwd_by_op == {"aten.addmm": 2 * 3 * 8 * 4}
    assert c.bwd_by_op["aten.mm"] == 2 * 3 * 8 * 4  # weight grad only; x needs no grad
    assert layer.weight.grad is None
    c2 = remat.count_flops(lambda input, scale: layer(input) * scale, (), {"input": x, "scale": 2.0})
    assert c2.fwd_by_op["aten.mul"] == 12


def test_batchnorm_buffers_are_not_updated():
    model = torchvision.models.resnet18()
    snap = _snapshot(model)
    remat.count_flops(model, (torch.randn(2, 3, 32, 32),))
    _assert_unchanged(model, snap)


@pytest.mark.parametrize("name, gmacs", [("resnet18", 1.814), ("resnet50", 4.089), ("vgg11", 7.609),
                                         ("mobilenet_v3_small", 0.057), ("vit_b_16", 17.564)])
def test_macs_match_torchvision_published(name, gmacs):
    published = torchvision.models.get_model_weights(name).DEFAULT.meta["_ops"]
    assert published == pytest.approx(gmacs)
    with torch.device("meta"):
        model = torchvision.models.get_model(name)
    c = remat.count_flops(model, (torch.empty(1, 3, 224, 224, device="meta"),))
    # published values have 3 decimals: allow 0.5 % or half a unit of the last digit
    assert abs(c.fwd_macs / 1e9 - published) <= max(0.005 * published, 0.0005)
