"""Mixed precision for every backbone family: a training step under fp16 autocast with dynamic
loss scaling (what --amp does: a step whose scaled gradients overflow is skipped and the scale
lowered) and under bf16 autocast, inputs scaled x1 and x100. The loss and the unscaled gradients
are finite, and the half-precision outputs stay close to float32 (relative L2 error below 2% for
fp16, 8% for bf16)."""
import pytest
import torch
import torch.nn.functional as F
from families import FAMILIES

TOL = {torch.float16: 0.02, torch.bfloat16: 0.08}


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def amp_step(model, x, dtype, max_tries=8):
    """One optimizer step (lr 0) with loss scaling; returns (loss, finite grads?, tries)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler('cpu', enabled=dtype == torch.float16)
    for tries in range(1, max_tries + 1):
        opt.zero_grad()
        with torch.autocast('cpu', dtype=dtype):
            outs = model(x)
            # O(1) loss whatever the input scale, as a real training loss
            loss = sum(o.float().pow(2).mean() / (o.detach().float().pow(2).mean() + 1)
                       for o in outs)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        finite = all(torch.isfinite(p.grad).all() for p in model.parameters()
                     if p.grad is not None)
        scaler.step(opt)
        scaler.update()
        if finite:
            return loss, True, tries
    return loss, False, max_tries


@pytest.mark.parametrize('dtype', [torch.float16, torch.bfloat16], ids=['fp16', 'bf16'])
@pytest.mark.parametrize('name', list(FAMILIES))
def test_training_step_under_autocast(name, dtype):
    torch.manual_seed(0)
    model = FAMILIES[name]()
    model.init_weights()
    for scale in (1, 100):
        x = torch.randn(2, 3, 64, 96) * scale
        model.train()
        loss, finite, tries = amp_step(model, x, dtype)
        assert torch.isfinite(loss), (name, scale, loss)
        assert finite, f'{name} x{scale}: gradients not finite after {tries} loss scales'
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
        model.eval()  # BatchNorm statistics moved in the step: compare in eval mode
        with torch.no_grad():
            ref = model(x)
            with torch.autocast('cpu', dtype=dtype):
                half = model(x)
        for o, r in zip(half, ref):
            assert torch.isfinite(o).all()
            assert rel_err(o, r) < TOL[dtype], (name, scale, rel_err(o, r))


#: aten ops whose CUDA kernels need the input and the affine parameters in one dtype (the CPU
#: kernels also take a half-precision input with float32 parameters): op -> (input, weight, bias)
#: argument positions
ONE_DTYPE_OPS = {torch.ops.aten.native_layer_norm.default: (0, 2, 3),
                 torch.ops.aten.native_layer_norm_backward.default: (1, 5, 6)}


class DtypeRules(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the calls of :data:`ONE_DTYPE_OPS` whose tensors' dtypes differ."""

    def __init__(self):
        super().__init__()
        self.mixed = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in ONE_DTYPE_OPS:
            dts = {args[i].dtype for i in ONE_DTYPE_OPS[func] if torch.is_tensor(args[i])}
            if func is torch.ops.aten.native_layer_norm_backward.default:
                dts.add(args[0].dtype)  # the output gradient too
            if len(dts) > 1:
                self.mixed.append((str(func), sorted(map(str, dts))))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize('dtype', [torch.float16, torch.bfloat16], ids=['fp16', 'bf16'])
@pytest.mark.parametrize('name', list(FAMILIES))
def test_training_step_under_autocast_keeps_cuda_dtype_rules(name, dtype, monkeypatch):
    """A training step under autocast calls no layer norm (forward or backward) with mixed
    dtypes: CUDA refuses those calls ('expected scalar type BFloat16 but found Float'), so a
    training form that only ran on CPU would fail there. CUDA's autocast runs ``layer_norm`` in
    float32, CPU's does not: ``F.layer_norm`` is given CUDA's policy here, so that the layer norms
    of plain modules see what they see on CUDA and the calls left are those of the kernels."""
    real = F.layer_norm

    def layer_norm_as_on_cuda(x, *args, **kwargs):
        if torch.is_autocast_enabled('cpu') and x.dtype in (torch.float16, torch.bfloat16):
            with torch.autocast('cpu', enabled=False):
                args = [a.float() if torch.is_tensor(a) else a for a in args]
                kwargs = {k: a.float() if torch.is_tensor(a) else a for k, a in kwargs.items()}
                return real(x.float(), *args, **kwargs)
        return real(x, *args, **kwargs)
    monkeypatch.setattr(F, 'layer_norm', layer_norm_as_on_cuda)
    torch.manual_seed(0)
    model = FAMILIES[name]()
    model.train()
    x = torch.randn(2, 3, 64, 96)
    with DtypeRules() as rules:
        with torch.autocast('cpu', dtype=dtype):
            loss = sum(o.float().pow(2).mean() for o in model(x))
        loss.backward()
    assert not rules.mixed, rules.mixed
