"""``linattn_mm.utils.autocast_meta``: CUDA's autocast for meta tensors.

Two oracles from torch itself: the operations that have an ``AutocastCUDA`` kernel in the
dispatcher, and CUDA's own autocast kernels run on fake CUDA tensors (a ``FakeTensorMode`` on a
machine without a GPU runs the forward of CUDA's dispatch, autocast included; only the backward
needs a device)."""
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from linattn_mm.ops.common import autocast_on, no_autocast
from linattn_mm.utils import OperationCounter
from linattn_mm.utils import autocast_meta as ma

pytestmark = pytest.mark.filterwarnings('ignore::UserWarning')


def test_the_lists_are_the_dispatchers_autocast_cuda_kernels():
    registered = {n[len('aten::'):] for n in torch._C._dispatch_get_all_op_names()
                  if n.startswith('aten::')
                  and torch._C._dispatch_has_kernel_for_dispatch_key(n, 'AutocastCUDA')}
    ours = (set(ma.LOWER_PRECISION) | set(ma.FP32) | set(ma.FP32_SET_OPT_DTYPE)
            | set(ma.FP32_APPEND_DTYPE) | set(ma.PROMOTE))
    # binary_cross_entropy's CUDA kernel raises ("unsafe to autocast"): not a cast policy
    assert registered - {'binary_cross_entropy'} == ours
    lists = [ma.LOWER_PRECISION, ma.FP32, ma.FP32_SET_OPT_DTYPE, list(ma.FP32_APPEND_DTYPE),
             ma.PROMOTE]
    assert sum(len(x) for x in lists) == len(ours)  # no operation in two lists


def _zoo(x, y, w, cw, cb, dw, ln_w, ln_b, gn_w, gn_b):
    """Operations of every policy and common ones of none (elementwise, means, cat), on
    float32 ``x`` (N, C), ``y`` (B, 3, H, W) and weights ``w`` (C, C), conv ``cw``, ``cb``,
    depth-wise ``dw``, norms; the outputs of each in order."""
    outs = []
    a = F.linear(x, w)                       # lower precision, a weight
    outs += [a, F.linear(a, w)]              # the weight's cast again (cached)
    outs += [a @ a.t(), torch.bmm(a[None], a.t()[None]), torch.einsum('nc,mc->nm', a, x)]
    outs += [torch.baddbmm(x[None, :, :4], a[None], w[None, :, :4])]
    c = F.conv2d(y, cw, cb, padding=1)
    outs += [c, F.conv2d(c, dw, padding=1, groups=dw.shape[0]),
             F.layer_norm(a, (a.shape[-1],), ln_w, ln_b), F.group_norm(c, 2, gn_w, gn_b)]
    outs += [a.exp(), a.log(), a ** 2, a.pow(x[:, :1]), a.rsqrt(), a.reciprocal()]
    outs += [a.sum(), a.sum(-1), a.mean(-1), a.softmax(-1), F.log_softmax(a, -1), a.cumsum(0)]
    outs += [a.sum(-1, dtype=torch.float16), a.norm(), a.norm(dim=-1),
             torch.linalg.vector_norm(a, dim=-1)]
    outs += [torch.ops.aten.norm.Scalar(a), torch.ops.aten.norm.ScalarOpt_dim(a, 2, [1]),
             torch.ops.aten.norm.ScalarOpt_dim(a, 3., [0], True)]  # norm's dtype overloads
    outs += [torch.addcmul(a, a, a)]  # promote, all in the autocast dtype
    outs += [torch.addcmul(x, a, x), torch.cat([a, x]), a + x, a * 2, F.gelu(a), F.silu(a),
             a.sigmoid(), a.tanh(), F.interpolate(c, scale_factor=2, mode='bilinear')]
    outs += [F.scaled_dot_product_attention(a[None, None], x[None, None], x[None, None])]
    return outs


def _zoo_args():
    g = torch.Generator().manual_seed(0)
    shapes = [(12, 16), (2, 3, 6, 6), (16, 16), (8, 3, 3, 3), (8,), (8, 1, 3, 3), (16,), (16,),
              (8,), (8,)]
    return [torch.randn(s, generator=g) for s in shapes]


class _Sequence(OperationCounter):
    """The operations run, in order, each with its output's dtype."""

    def __init__(self):
        super().__init__()
        self.seq = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        self.seq.append((func.overloadpacket.__name__, getattr(out, 'dtype', None)))
        return out


def _run(device, dtype):
    """Output dtypes and operations of the zoo under CUDA's autocast: on fake CUDA tensors
    (``device='cuda'``, CUDA's own kernels) or on meta tensors in a :func:`meta_autocast`."""
    args = _zoo_args()
    with _Sequence() as ops:
        if device == 'meta':
            args = [t.to('meta') for t in args]
            args[2].requires_grad_()
            with ma.meta_autocast(dtype):
                outs = _zoo(*args)
        else:
            from torch._subclasses.fake_tensor import FakeTensorMode
            with FakeTensorMode() as fake:
                args = [fake.from_tensor(t).to('cuda') for t in args]
                args[2].requires_grad_()
                torch.set_autocast_enabled('cuda', True)
                torch.set_autocast_dtype('cuda', dtype)
                torch.autocast_increment_nesting()
                try:
                    # attention as meta decomposes it: on a machine with a GPU, fake CUDA
                    # tensors would pick that GPU's fused kernel (cuDNN's on an H200), a choice
                    # of backend, not of autocast's casts
                    with sdpa_kernel(SDPBackend.MATH):
                        outs = _zoo(*args)
                finally:
                    torch.set_autocast_enabled('cuda', False)
                    if torch.autocast_decrement_nesting() == 0:
                        torch.clear_autocast_cache()
    return [o.dtype for o in outs], ops.seq


@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
def test_dtypes_and_casts_equal_cudas_autocast_kernels(dtype):
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        try:
            want, want_ops = _run('cuda', dtype)
        except (RuntimeError, AssertionError) as e:  # a torch without CUDA's dispatch
            pytest.skip(f'fake CUDA tensors unavailable: {e}')
    got, got_ops = _run('meta', dtype)
    assert got == want
    assert dtype in got and torch.float32 in got
    # the same operations in the same order, each with the dtype of its output: the weight cast
    # once (cached), the inputs of each lower-precision / float32 operation once per use, half
    # softmax read as it is (fake CUDA tensors also ask for their device: not an operation)
    assert [op for op in got_ops if op[0] != 'device'] == [
        op for op in want_ops if op[0] != 'device']
    assert sum(op[0] == '_to_copy' for op in got_ops) > 10


def test_training_step_equals_cpu_autocast_where_the_policies_agree():
    """The backward too: products of linear layers (lower precision on CPU and CUDA alike) under
    CPU's own autocast and under the meta region record the same casts and run the same
    operations both ways; the gradients come back in float32, each weight cast once forward."""
    def step(x, lin, autocast):
        with OperationCounter() as ops:
            with autocast:
                h = lin(lin(x))  # the weight and bias used twice
            assert h.dtype == torch.bfloat16
            grads = torch.autograd.grad(h.float().square().sum(), (x, lin.weight, lin.bias))
        assert all(g.dtype == torch.float32 for g in grads)
        return ops.by_name

    lin = torch.nn.Linear(16, 16)
    x = torch.randn(8, 16, requires_grad=True)
    want = step(x, lin, torch.autocast('cpu', dtype=torch.bfloat16))
    lin_meta = lin.to('meta')
    got = step(torch.empty(8, 16, device='meta', requires_grad=True), lin_meta,
               ma.meta_autocast(torch.bfloat16))
    assert got == want
    # forward: x, the weight and the bias once each, h.float(); backward: the gradient of h
    # back to bfloat16, those of x, the weight and the bias to float32
    assert got['_to_copy'] == 4 + 4


def test_the_plugins_autocast_checks_see_the_region():
    dev = torch.device('meta')
    assert not autocast_on(dev)
    with ma.meta_autocast(torch.float16):
        assert autocast_on(dev) and ma.meta_autocast_dtype() == torch.float16
        with no_autocast(dev):
            assert not autocast_on(dev)
            a = torch.empty(4, 4, device='meta')
            assert (a @ a).dtype == torch.float32
        assert autocast_on(dev)
    assert not autocast_on(dev) and ma.meta_autocast_dtype() is None
    a = torch.empty(4, 4, device='meta')
    assert (a @ a).dtype == torch.float32  # nothing left installed


def test_cpu_tensors_and_bad_use():
    a = torch.randn(4, 4)
    with ma.meta_autocast():
        assert (a @ a).dtype == torch.float32  # CPU tensors: torch.autocast('cpu') is theirs
        with pytest.raises(RuntimeError, match='already active'):
            with ma.meta_autocast():
                pass
    with pytest.raises(ValueError, match='torch.bfloat16 or torch.float16'):
        with ma.meta_autocast(torch.float32):
            pass


def test_region_leaves_nothing_behind_even_on_error():
    """The kernels are the dispatcher's own again after a region, and the switches as they were,
    when its body raises too."""
    before = torch._C._dispatch_dump('aten::mm')
    with pytest.raises(ZeroDivisionError):
        with ma.meta_autocast(torch.bfloat16):
            assert 'autocast_meta' in torch._C._dispatch_dump('aten::mm')
            1 / 0
    assert torch._C._dispatch_dump('aten::mm') == before
    assert ma.meta_autocast_dtype() is None and not torch.is_autocast_enabled('xpu')
    with ma.meta_autocast(torch.float16):  # and a new region works
        a = torch.empty(2, 2, device='meta')
        assert (a @ a).dtype == torch.float16


def test_promote_refuses_half_and_bfloat16_together_as_cuda_does():
    a = torch.empty(3, 3, device='meta', dtype=torch.bfloat16)
    with ma.meta_autocast(torch.bfloat16):
        assert torch.addcmul(a, a, a).dtype == torch.bfloat16
        assert torch.addcmul(a.float(), a, a).dtype == torch.float32
        with pytest.raises(RuntimeError, match='float16'):
            torch.addcmul(a, a.half(), a)


def test_recomputation_and_float32_mixers_under_the_region():
    """A mixer that runs its core in float32 under autocast (SeT, PADRe, Poly-SA:
    ``run_in_fp32``) and whose training form recomputes it in the backward
    (``ops.lean_layers.recomputed``): under the region its forward gives float32, and the
    backward's recomputation runs in the forward's dtypes (checkpointing would refuse otherwise)."""
    from linattn_mm.models.attentions import build_attention
    from linattn_mm.ops.lean_layers import recomputed
    for cfg in (dict(type='PADReMixer'), dict(type='PolySelfAttention')):
        m = build_attention(dict(cfg, embed_dims=32, num_heads=2)).to('meta').train()
        x = torch.empty(2, 48, 32, device='meta', requires_grad=True)
        with ma.meta_autocast(torch.bfloat16):
            y = m(x, (6, 8))
        y.float().sum().backward()
        assert x.grad is not None and x.grad.shape == x.shape
    lin = torch.nn.Linear(8, 8).to('meta')
    x = torch.empty(4, 8, device='meta', requires_grad=True)
    with ma.meta_autocast(torch.bfloat16):
        y = recomputed(lambda t: lin(t).exp(), x)
    assert y.dtype == torch.float32  # exp: float32 policy, of the bf16 product
    y.sum().backward()
    assert x.grad.dtype == torch.float32


def _small_backbones(with_cp):
    from linattn_mm.models.backbones import LinAttnPVTv2, LinAttnSwin
    from linattn_mm.models.backbones.nalaformer import NaLaFormer
    from linattn_mm.models.backbones.resnet_polynl import PolyNLResNet
    from linattn_mm.models.backbones.setformer import SeTformer
    small = dict(embed_dims=16, depths=[1, 1, 2, 1], num_heads=[1, 2, 2, 4])
    return {
        'Pola-Swin': LinAttnSwin(arch=small, attn_cfg=dict(type='PolaLinearAttention'),
                                 drop_path_rate=0., with_cp=with_cp),
        'PVTv2-b0': LinAttnPVTv2(arch='b0', drop_path_rate=0., with_cp=with_cp),
        'NaLaFormer-xt': NaLaFormer('xt', drop_path_rate=0., with_cp=with_cp),
        'SeTformer': SeTformer(arch=dict(small, mlp_ratio=2.), drop_path_rate=0.,
                               attn_cfg=dict(type='SeTAttention', num_refs=8, num_iters=5),
                               with_cp=with_cp),
        'PolyNL-ResNet-50': PolyNLResNet(50, pad_mask=None, with_cp=with_cp),  # no data on meta
    }


def test_with_cp_counts_under_the_region():
    """Gradient checkpointing (``with_cp``) of every skeleton counted on ``meta`` under the
    region: its recomputation in the backward runs in the forward's dtypes (checkpointing
    restores autocast for the devices it knows only, and refused the recomputed bf16 tensors),
    every parameter gets the gradient it gets without checkpointing, the recomputed forward is
    counted again, and the peak is lower."""
    from linattn_mm.utils import PeakMemoryCounter

    def step(model):
        model = model.to('meta').train()
        x = torch.empty(2, 3, 96, 128, device='meta')
        with OperationCounter() as ops, PeakMemoryCounter(include_meta=True) as mem:
            with ma.meta_autocast(torch.bfloat16):
                loss = sum(o.float().square().mean() for o in model(x))
            loss.backward()
        return ops.total, mem.peak_bytes, {n: (p.grad.shape, p.grad.dtype)
                                           for n, p in model.named_parameters()
                                           if p.grad is not None}

    plain, cp = _small_backbones(False), _small_backbones(True)
    for name in plain:
        ops, peak, grads = step(plain[name])
        ops_cp, peak_cp, grads_cp = step(cp[name])
        assert grads_cp == grads and len(grads) == len(list(plain[name].parameters())), name
        assert ops_cp > ops and peak_cp < peak, (name, ops, ops_cp, peak, peak_cp)
