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


def compiled_and_eager(model, x):
    """One training step of ``model`` on ``x`` eager and under ``torch.compile`` (``aot_eager``,
    traced once): the number of graphs dynamo captured, its graph breaks (reason -> count; with
    ``dynamo.explain``'s reasons when there are any) and the loss, input and parameter gradients
    of both steps."""
    import torch._dynamo as dynamo
    from torch._dynamo.backends.registry import lookup_backend
    from torch._dynamo.utils import counters
    step = training_step(model)
    graphs = []

    def one_trace(gm, example_inputs):  # aot_eager, counting the graphs dynamo hands over
        graphs.append(gm)
        return lookup_backend('aot_eager')(gm, example_inputs)

    dynamo.reset()
    counters.clear()
    grads = {}
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')  # dynamo's note on the tables' lru_cache
        for form, fn in (('eager', step), ('compiled', torch.compile(step, backend=one_trace))):
            model.zero_grad(set_to_none=True)
            xi = x.clone().requires_grad_()
            loss = fn(xi)
            loss.backward()
            grads[form] = [loss.detach(), xi.grad] + [p.grad for p in model.parameters()
                                                       if p.grad is not None]
        breaks = dict(counters['graph_break'])
        if len(graphs) != 1 or breaks:
            explained = dynamo.explain(step)(x)
            breaks['explain'] = [str(r.reason).splitlines()[0] for r in explained.break_reasons]
    dynamo.reset()
    return len(graphs), breaks, grads


@pytest.mark.slow
@pytest.mark.parametrize('name', NAMES)
def test_training_step_compiles_in_one_graph_with_the_eager_gradients(name):
    torch.manual_seed(0)
    # eval: no drop path, both steps take the same path; float64: the small random models'
    # float32 gradients are 0.1-1 % off the exact ones in either form
    model = FAMILIES[name]().eval().double()
    graphs, breaks, grads = compiled_and_eager(model, torch.randn(2, 3, 64, 96,
                                                                  dtype=torch.float64))
    assert graphs == 1 and not breaks, (graphs, breaks)
    assert len(grads['compiled']) == len(grads['eager']) > 2
    for i, (a, b) in enumerate(zip(grads['compiled'], grads['eager'])):
        assert a.dtype == b.dtype == torch.float64 and rel(a, b) < 1e-10, (i, rel(a, b))


def test_a_graph_break_is_seen():
    """The check above on a model that breaks its graph once: more than one graph (the step's
    frame resumes in a third after the model's), the break named."""
    import torch.nn as nn

    class Breaks(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4).double(), nn.Linear(4, 4).double()

        def forward(self, x):
            y = self.a(x)
            torch._dynamo.graph_break()
            return [self.b(y)]

    graphs, breaks, grads = compiled_and_eager(Breaks(), torch.randn(3, 4, dtype=torch.float64))
    assert graphs > 1 and len(breaks) == 2 and breaks['explain'] == [
        'Call to `torch._dynamo.graph_break()`'], breaks
    for a, b in zip(grads['compiled'], grads['eager']):
        assert rel(a, b) < 1e-12


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
