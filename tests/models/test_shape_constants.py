"""The tables that depend on shapes only (window layouts, shift masks, interpolation matrices of
the position encodings): made once and kept (``linattn_mm.models.utils.constants``), usable by a
training step after an inference run made them, and never copied from the host in a step on
another device."""
import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from families import FAMILIES
from linattn_mm.models.backbones.resnet_polynl import PolyNLResNet
from linattn_mm.models.utils.constants import clear_shape_constants

BUILDERS = dict(FAMILIES)
# pad_mask='infer' reads the padding of every image from the input (a host read by design);
# without it the ResNet's Poly-NL blocks take the device path of the others
BUILDERS['r50-polynl'] = lambda: PolyNLResNet(pad_mask=None)


def loss_of(outs):
    return sum(o.float().square().mean() for o in outs)


def input_and_param_grads(model, x):
    model.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    loss_of(model(x)).backward()
    return [x.grad] + [p.grad for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize('name', sorted(FAMILIES))
def test_tables_made_in_inference_mode_serve_a_training_step(name):
    """An inference run under ``torch.inference_mode()`` makes the tables for its input size; a
    training step at the same size then saves them for backward (tensors made in inference mode
    cannot be: the tables are made with it off) and gets the gradients of a step whose tables were
    made with autograd on."""
    torch.manual_seed(0)
    model = FAMILIES[name]().eval()  # eval: no dropout / drop path, the two steps are equal
    x = torch.randn(1, 3, 64, 96)
    clear_shape_constants()
    expected = input_and_param_grads(model, x)
    clear_shape_constants()
    with torch.inference_mode():
        model(x)
    got = input_and_param_grads(model, x)
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=0)


class HostTensors(TorchDispatchMode):
    """Records the operations that take a host (CPU) tensor with elements while the model runs on
    another device: on a GPU, each is a copy from the host that waits for the GPU's queue."""

    def __init__(self):
        super().__init__()
        self.hits = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if any(t.device.type == 'cpu' and t.dim() > 0 for t in tensors):
            where = [f for f in traceback.extract_stack() if 'linattn_mm' in f.filename]
            self.hits.append((func.overloadpacket.__name__,
                              f'{where[-1].filename}:{where[-1].lineno}' if where else '?'))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize('name', sorted(BUILDERS))
def test_training_step_off_cpu_takes_nothing_from_the_host(name):
    """A training step on ``meta`` tensors (the paths taken on a GPU) after a first one: no
    operation meets a host tensor (the resized position encodings' interpolation matrices were
    copied from the host in every block of every step)."""
    model = BUILDERS[name]().to('meta').train()
    x = torch.randn(2, 3, 64, 96, device='meta')
    loss_of(model(x)).backward()
    with HostTensors() as seen:
        loss_of(model(x)).backward()
    assert seen.hits == []


def test_a_table_made_under_a_fake_tensor_mode_is_not_kept():
    """Under a fake tensor mode (tracing, export) a table is made as a fake tensor and not cached:
    the next real call gets a real one."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    from linattn_mm.models.attentions.softmax import shift_window_mask
    clear_shape_constants()
    with FakeTensorMode():
        fake = shift_window_mask(14, 14, 7, 3, torch.device('cpu'), torch.float32)
    real = shift_window_mask(14, 14, 7, 3, torch.device('cpu'), torch.float32)
    assert isinstance(fake, FakeTensor) and type(real) is torch.Tensor
    assert real.shape == (4, 49, 49) and set(real.unique().tolist()) == {0., -100.}
