"""Training under ``torch.compile`` (mmengine's ``cfg.compile``): every family's training step is
traced in one graph, without a break (a break leaves the operations around it unfused, each a
launch of its own on a GPU), and the compiled step gives the gradients of the eager one.
``aot_eager`` runs the traced forward and backward graphs op by op (what the compiler receives,
without generating code), so these tests need no C++ compiler. Float64: the gradients agree to
1e-10 relative."""
import warnings

import pytest
import torch

from families import FAMILIES

# the families whose mixers are the plugin's own training forms, and the softmax ones
NAMES = ['pola-swin', 'pola-pvt', 'nalaformer', 'pola-nat', 'nala-nat', 'swin-softmax',
         'padre-swin', 'poly-swin', 'poly-pvt', 'setformer']


def training_step(model):
    def step(x):
        return sum(o.square().mean() for o in model(x))
    return step


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


@pytest.mark.slow
@pytest.mark.parametrize('name', NAMES)
def test_training_step_compiles_in_one_graph_with_the_eager_gradients(name):
    import torch._dynamo as dynamo
    torch.manual_seed(0)
    # eval: no drop path, both steps take the same path; float64: the small random models'
    # float32 gradients are 0.1-1 % off the exact ones in either form
    model = FAMILIES[name]().eval().double()
    x = torch.randn(2, 3, 64, 96, dtype=torch.float64)
    step = training_step(model)
    dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')  # dynamo's note on the tables' lru_cache
        explained = dynamo.explain(step)(x)
        assert explained.graph_break_count == 0, [str(r.reason).splitlines()[0]
                                                  for r in explained.break_reasons]
        grads = {}
        for form, fn in (('eager', step), ('compiled', torch.compile(step, backend='aot_eager'))):
            model.zero_grad(set_to_none=True)
            xi = x.clone().requires_grad_()
            loss = fn(xi)
            loss.backward()
            grads[form] = [loss.detach(), xi.grad] + [p.grad for p in model.parameters()
                                                       if p.grad is not None]
    dynamo.reset()
    assert len(grads['compiled']) == len(grads['eager']) > 2
    for i, (a, b) in enumerate(zip(grads['compiled'], grads['eager'])):
        assert a.dtype == b.dtype == torch.float64 and rel(a, b) < 1e-10, (i, rel(a, b))


def test_compile_backbone_keeps_the_state_dict_and_the_gradients():
    """``compile_backbone`` (and the hook that calls it when training starts) compiles the
    backbone of a (possibly wrapped) model in place: the state dict keys stay, a second call
    leaves it as it is, the gradients are the eager ones; a model without a backbone gets a clear
    error."""
    import torch.nn as nn

    from linattn_mm.compile_hook import CompileBackboneHook, compile_backbone

    class Detector(nn.Module):
        def __init__(self):
            super().__init__()
            self.backbone = FAMILIES['pola-swin']().eval().double()

        def forward(self, x):
            return sum(o.square().mean() for o in self.backbone(x))

    class Wrapped(nn.Module):  # as DDP: the model under .module
        def __init__(self, module):
            super().__init__()
            self.module = module

    class Runner:
        def __init__(self, model):
            self.model = model
            self.logger = type('L', (), {'info': staticmethod(lambda msg: None)})()

    torch.manual_seed(0)
    det = Detector()
    keys = list(det.state_dict())
    x = torch.randn(1, 3, 64, 96, dtype=torch.float64)
    det(x).backward()
    eager = [p.grad.clone() for p in det.parameters() if p.grad is not None]
    CompileBackboneHook(backend='aot_eager').before_train(Runner(Wrapped(det)))
    compiled = det.backbone.forward
    assert compile_backbone(det, backend='aot_eager') is det.backbone
    assert det.backbone.forward is compiled and list(det.state_dict()) == keys
    det.zero_grad(set_to_none=True)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        det(x).backward()
    got = [p.grad for p in det.parameters() if p.grad is not None]
    assert len(got) == len(eager) and all(rel(a, b) < 1e-10 for a, b in zip(got, eager))
    torch._dynamo.reset()
    with pytest.raises(ValueError, match='has no backbone module to compile'):
        compile_backbone(nn.Linear(2, 2))
