"""NaLaFormer family: the norm-aware linear attention against direct float64 implementations of
the formulas (official-code and paper kernels), the gated softmax block, the native hierarchy
(parameter counts, shapes, official checkpoints), NaLa in the Swin/PVT skeletons, and numerics
(zero-norm queries, fp16/bf16 autocast)."""
import argparse
import math

import pytest
import torch
import torch.nn.functional as F

import linattn_mm
from linattn_mm.models.attentions import build_attention
from linattn_mm.models.attentions.nala import (NaLaSoftmaxAttention, NormAwareLinearAttention,
                                               RoPE2d)
from linattn_mm.models.backbones import LinAttnPVT, LinAttnSwin
from linattn_mm.models.backbones.nalaformer import NaLaFormer


# ------------------------------------------------------------------------------------------------
# direct float64 references written from the formulas
# ------------------------------------------------------------------------------------------------
def rope_angles(H, W, d, base=10000.):
    """(N, d/2) rotation angle of every channel pair: pairs 0..d/4-1 turn with the row index,
    pairs d/4..d/2-1 with the column index, frequency base ** (-m / (d/4 - 1))."""
    n = d // 4
    freq = torch.tensor([base ** (-m / (n - 1)) if n > 1 else 1. for m in range(n)],
                        dtype=torch.float64)
    ys, xs = torch.meshgrid(torch.arange(H, dtype=torch.float64),
                            torch.arange(W, dtype=torch.float64), indexing='ij')
    ys, xs = ys.reshape(-1, 1), xs.reshape(-1, 1)
    return torch.cat([ys * freq, xs * freq], dim=1)


def rotate(f, ang):
    """Rotate consecutive pairs of every d-channel chunk of f (N, k*d) by ang (N, d/2)."""
    N, D = f.shape
    d = 2 * ang.shape[1]
    out = f.clone()
    for c in range(0, D, d):
        for m in range(d // 2):
            a, b = f[:, c + 2 * m], f[:, c + 2 * m + 1]
            cs, sn = torch.cos(ang[:, m]), torch.sin(ang[:, m])
            out[:, c + 2 * m] = a * cs - b * sn
            out[:, c + 2 * m + 1] = b * cs + a * sn
    return out


def features(q, k, kernel, lam=3.):
    """phi_q (N, 2d), phi_k (N, 2d) of one head, written element by element from the formulas."""
    qn = q.norm(dim=1, keepdim=True)
    dq = q / qn
    p = lam * (0.5 + torch.tanh(qn))
    if kernel == 'official':
        k3 = k ** 3
        phi_q = torch.cat([torch.clamp(dq, min=0) ** p, torch.clamp(-dq, min=0) ** p], 1)
        phi_k = torch.cat([torch.clamp(k3, min=0), torch.clamp(-k3, min=0)], 1)
    else:
        f = lambda t: math.pi / 4 * torch.tanh(t)  # noqa: E731
        dk = k / k.norm(dim=1, keepdim=True)
        mq, mk = dq.abs() ** p, k.abs() ** lam
        phi_q = torch.cat([mq * torch.cos(f(dq)), mq * torch.sin(f(dq))], 1)
        phi_k = torch.cat([mk * torch.cos(f(dk)), mk * torch.sin(f(dk))], 1)
    return phi_q, phi_k


def gated_output(m, x_b, attn, v_grid_b, g, H, W):
    """out_proj(LN(attn + LePE(v)) * SiLU(g)) for one image."""
    C = attn.shape[1]
    lepe = F.conv2d(v_grid_b.T.reshape(1, C, H, W), m.lepe.weight, m.lepe.bias,
                    padding=m.lepe.padding, groups=C).reshape(C, -1).T
    y = F.layer_norm(attn + lepe, (C, ), m.ln.weight, m.ln.bias, m.ln.eps)
    y = y * (g * torch.sigmoid(g))
    return y @ m.out_proj.weight.T + m.out_proj.bias


def nala_reference(m, x, H, W, kernel, eps=1e-6):
    """o_i = (1/N) sum_j [R_i phi_q(q_i)] . [R_j phi_k(k_j)] v_j / ((1/N) sum_j phi_q(q_i) .
    phi_k(k_j) + eps), per head; then LePE, LN, SiLU gate and the output projection."""
    B, N, C = x.shape
    h = m.num_heads
    d = C // h
    ang = rope_angles(H, W, d)
    outs = []
    for b in range(B):
        q, k, v, g = (x[b] @ m.qkvg.weight.T + m.qkvg.bias).split(C, dim=1)
        heads = []
        for i in range(h):
            sl = slice(i * d, (i + 1) * d)
            fq, fk = features(q[:, sl], k[:, sl], kernel)
            num = rotate(fq, ang) @ rotate(fk, ang).T / N  # (N, N) rotated numerator weights
            den = (fq @ fk.T).sum(1, keepdim=True) / N + eps  # unrotated denominator
            heads.append(num @ v[:, sl] / den)
        outs.append(gated_output(m, x[b], torch.cat(heads, 1), v, g, H, W))
    return torch.stack(outs)


def softmax_reference(m, x, H, W):
    B, N, C = x.shape
    h = m.num_heads
    d = C // h
    ang = rope_angles(H, W, d)
    outs = []
    for b in range(B):
        q, k, v, g = (x[b] @ m.qkvg.weight.T + m.qkvg.bias).split(C, dim=1)
        heads = []
        for i in range(h):
            sl = slice(i * d, (i + 1) * d)
            logits = rotate(q[:, sl], ang) @ rotate(k[:, sl], ang).T / math.sqrt(d)
            heads.append(torch.softmax(logits, 1) @ v[:, sl])
        outs.append(gated_output(m, x[b], torch.cat(heads, 1), v, g, H, W))
    return torch.stack(outs)


def randomise(module, scale=0.3):
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, scale)
    return module


# ------------------------------------------------------------------------------------------------
# attention
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize('kernel', ['official', 'paper'])
@pytest.mark.parametrize('C,h,H,W', [(16, 2, 3, 5), (24, 2, 4, 4)])
def test_nala_matches_float64_formula(kernel, C, h, H, W):
    torch.manual_seed(0)
    m = randomise(NormAwareLinearAttention(C, h, kernel=kernel)).double().eval()
    x = torch.randn(2, H * W, C, dtype=torch.float64)
    ref = nala_reference(m, x, H, W, kernel)
    torch.testing.assert_close(m(x, (H, W)), ref, rtol=1e-6, atol=1e-6)
    # the float32 module (the default precision) agrees to float32 accuracy
    m32 = m.float()
    torch.testing.assert_close(m32(x.float(), (H, W)).double(), ref, rtol=1e-4, atol=1e-4)


def test_nala_kernels_differ_and_are_non_negative():
    torch.manual_seed(1)
    q, k = torch.randn(2, 10, 8, dtype=torch.float64), torch.randn(2, 10, 8, dtype=torch.float64)
    official = NormAwareLinearAttention(16, 2).double()
    paper = NormAwareLinearAttention(16, 2, kernel='paper').double()
    for m in (official, paper):
        fq, fk = m.feature_maps(q, k)
        assert fq.shape == fk.shape == (2, 10, 16)
        assert (fq @ fk.transpose(-1, -2) >= 0).all()
    # official: same-signed dimensions only; paper: cos of the mapped direction difference
    fq, fk = official.feature_maps(q, k)
    dq = q / q.norm(dim=-1, keepdim=True)
    p = 3 * (0.5 + torch.tanh(q.norm(dim=-1, keepdim=True)))
    same = ((dq[..., :, None, :] * k[..., None, :, :] ** 3) > 0)
    prod = dq.abs()[..., :, None, :] ** p[..., None] * k.abs()[..., None, :, :] ** 3
    want = (prod * same).sum(-1)
    torch.testing.assert_close(fq @ fk.transpose(-1, -2), want)
    pq, pk = paper.feature_maps(q, k)
    f = lambda t: math.pi / 4 * torch.tanh(t)  # noqa: E731
    dk = k / k.norm(dim=-1, keepdim=True)
    cos = torch.cos(f(dq)[..., :, None, :] - f(dk)[..., None, :, :])  # Eq. 17, in [0, 1]
    assert (cos >= 0).all()
    want_paper = (dq.abs()[..., :, None, :] ** p[..., None] * k.abs()[..., None, :, :] ** 3
                  * cos).sum(-1)
    torch.testing.assert_close(pq @ pk.transpose(-1, -2), want_paper)
    assert not torch.allclose(want_paper, want)


def test_softmax_block_matches_float64_formula():
    torch.manual_seed(0)
    C, h, H, W = 16, 2, 3, 4
    m = randomise(NaLaSoftmaxAttention(C, h)).double().eval()
    x = torch.randn(2, H * W, C, dtype=torch.float64)
    torch.testing.assert_close(m(x, (H, W)), softmax_reference(m, x, H, W), rtol=1e-6,
                               atol=1e-6)


def test_softmax_block_under_autocast_runs_its_products_in_half_precision():
    """As the released block under autocast: it casts q, k, v to float32 and rotates them in
    float32, and autocast then runs its two matmuls on bfloat16 copies. The fused attention gets
    bfloat16 q, k and v that are the float64 formula's rotated q, k and v rounded once to
    bfloat16 (a rotation in bfloat16 would round each product and the sum: further off), it
    keeps bfloat16 token maps for backward and no float32 ones, and the block's output is the
    float64 formula within bfloat16's rounding. Without autocast nothing is rounded (the float64
    test above)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    torch.manual_seed(0)
    C, h, H, W = 32, 2, 6, 7
    d, N = C // h, H * W
    m = randomise(NaLaSoftmaxAttention(C, h), scale=0.2).train()
    with torch.no_grad():  # weights and input exactly representable in bfloat16
        for p in m.parameters():
            p.copy_(p.bfloat16())
    x = torch.randn(2, N, C).bfloat16().float().requires_grad_()

    class AttentionInputs(TorchDispatchMode):  # what the attention kernel gets, after autocast
        seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if 'scaled_dot_product' in func.__name__ and 'backward' not in func.__name__:
                self.seen.append([t.detach().clone() for t in args[:3]])
            return func(*args, **(kwargs or {}))
    maps = []

    def pack(t):
        if t.dim() == 4 and t.shape[-2:] == (N, d):
            maps.append(t.dtype)
        return t
    with torch.autocast('cpu', dtype=torch.bfloat16), AttentionInputs() as seen, \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = m(x, (H, W))
    assert out.dtype == torch.bfloat16 and len(maps) >= 3 and set(maps) == {torch.bfloat16}
    (q, k, v), = seen.seen
    assert q.dtype == k.dtype == v.dtype == torch.bfloat16
    out.float().sum().backward()
    assert torch.isfinite(x.grad).all()
    # the float64 formula's projections (bfloat16 under autocast: rounded once), rotated in float64
    md, xd = m.double(), x.detach().double()
    qd, kd, vd, _ = (xd @ md.qkvg.weight.T + md.qkvg.bias).bfloat16().double().split(C, dim=-1)
    ang = rope_angles(H, W, d)
    heads = lambda t: t.view(2, N, h, d).transpose(1, 2)  # noqa: E731
    for got, want in ((q, qd), (k, kd)):
        want = torch.stack([torch.cat([rotate(want[b, :, i * d:(i + 1) * d], ang)
                                       for i in range(h)], 1) for b in range(2)])
        want = heads(want)
        rounded = want.bfloat16().double()
        # rounded once from float32: equal to the float64 value rounded, but for rare ties
        assert (got.double() != rounded).double().mean() < 0.01
        assert ((got.double() - want).abs() <= want.abs() * 2 ** -8 + 1e-30).all()
    assert torch.equal(v, heads(vd).bfloat16())
    ref = softmax_reference(md, xd, H, W)
    err = (out.double() - ref).abs().max() / ref.abs().max()
    assert err < 1e-2, err


def test_rope_module_and_shared_rope_argument():
    rope = RoPE2d(16)
    assert rope.angle.shape == (8, )
    torch.testing.assert_close(rope.angle[::2], 1 / 10000 ** torch.linspace(0, 1, 4))
    sin, cos = rope((3, 5))
    ang = rope_angles(3, 5, 16)
    torch.testing.assert_close(sin.double(), torch.sin(ang.repeat_interleave(2, 1)))
    torch.testing.assert_close(cos.double(), torch.cos(ang.repeat_interleave(2, 1)))
    m = NormAwareLinearAttention(32, 2).eval()
    x = torch.randn(1, 15, 32)
    torch.testing.assert_close(m(x, (3, 5)), m(x, (3, 5), rope=rope((3, 5))))
    with pytest.raises(ValueError, match='divisible by 4'):
        NormAwareLinearAttention(36, 2)  # head size 18
    NormAwareLinearAttention(36, 2, use_rope=False)(torch.randn(1, 6, 36), (2, 3))


def test_attention_options_and_errors():
    with pytest.raises(ValueError, match='kernel'):
        NormAwareLinearAttention(16, 2, kernel='cosine')
    with pytest.raises(ValueError, match='class'):
        build_attention(dict(type='NormAwareLinearAttention'), embed_dims=16, num_heads=2,
                        num_extra_tokens=1)
    m = build_attention(dict(type='NormAwareLinearAttention', kernel='paper'), embed_dims=32,
                        num_heads=2, sr_ratio=8, qkv_bias=False, proj_drop=0.1, block_idx=3)
    assert m.kernel == 'paper' and m.qkvg.bias is None and m.proj_drop.p == 0.1
    # official parameter names (and no extra state-dict keys of the attention's own RoPE)
    assert set(m.state_dict()) == {'qkvg.weight', 'lepe.weight', 'lepe.bias', 'ln.weight',
                                   'ln.bias', 'out_proj.weight', 'out_proj.bias'}
    assert tuple(m.lepe.weight.shape) == (32, 1, 5, 5)


def test_zero_norm_query_is_finite():
    torch.manual_seed(0)
    for kernel in ('official', 'paper'):
        m = NormAwareLinearAttention(16, 2, kernel=kernel)
        fq, fk = m.feature_maps(torch.zeros(1, 2, 5, 8), torch.randn(1, 2, 5, 8))
        assert torch.isfinite(fq).all() and (fq == 0).all()
        with torch.no_grad():
            m.qkvg.bias.zero_()  # a zero input token then has q = 0 (and k = v = g = 0)
        x = torch.randn(2, 12, 16)
        x[:, 5] = 0
        x.requires_grad_(True)
        y = m(x, (3, 4))
        y.sum().backward()
        assert torch.isfinite(y).all() and torch.isfinite(x.grad).all()
        assert all(torch.isfinite(p.grad).all() for p in m.parameters())


@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
def test_attention_autocast_large_inputs(dtype):
    torch.manual_seed(0)
    for m in (NormAwareLinearAttention(32, 2), NormAwareLinearAttention(32, 2, kernel='paper'),
              NaLaSoftmaxAttention(32, 2)):
        x = (torch.randn(2, 35, 32) * 100).requires_grad_(True)
        with torch.autocast('cpu', dtype=dtype):
            y = m(x, (5, 7))
        assert y.dtype == dtype
        y.float().pow(2).mean().backward()
        assert torch.isfinite(y).all(), type(m).__name__
        assert torch.isfinite(x.grad).all()
        assert all(torch.isfinite(p.grad).all() for p in m.parameters())


def test_nala_large_grid_shape():
    """Stage-1 token grid of an 800x1333 detection input (66.8k tokens)."""
    m = NormAwareLinearAttention(16, 1).eval()
    with torch.no_grad():
        y = m(torch.randn(1, 200 * 334, 16), (200, 334))
    assert y.shape == (1, 200 * 334, 16) and torch.isfinite(y).all()


# ------------------------------------------------------------------------------------------------
# native hierarchy
# ------------------------------------------------------------------------------------------------
def n_params(m):
    return sum(p.numel() for p in m.parameters())


@pytest.mark.parametrize('arch,paper_m', [('s', 26), ('b', 52), ('l', 95)])
def test_parameter_counts_match_paper(arch, paper_m):
    """The paper's Table 1 counts the whole classifier (proj, BN and 1x1 conv head included)."""
    n = n_params(NaLaFormer(arch, num_classes=1000, out_indices=()))
    assert abs(n / (paper_m * 1e6) - 1) < 0.03, n


def test_parameter_count_tiny():
    """NaLaFormer-T counts 15.91M with the classifier (the official code's analytic count, spec
    section 2.1): 6% above the paper's "15M", which is 15.9M truncated (S/B/L are rounded). Without
    the classifier it is 14.36M (-4.3%), so no reading puts T within 3% of 15M."""
    n = n_params(NaLaFormer('t', num_classes=1000, out_indices=()))
    assert abs(n / 15.9e6 - 1) < 0.005 and int(n / 1e6) == 15, n
    dense = n_params(NaLaFormer('t'))
    assert abs(dense / 14.36e6 - 1) < 0.005, dense


def test_swin_and_pvt_with_nala():
    nala = dict(type='NormAwareLinearAttention')
    win = dict(type='WindowSoftmaxAttention', window_size=7)
    swin = LinAttnSwin('t', attn_cfg=[nala, nala, win, win], out_indices=(3, ))
    n = n_params(swin) + 768 * 1000 + 1000  # + linear head
    assert abs(n / 29e6 - 1) < 0.03, n  # Table 6: NaLa-Swin-T 29M
    assert type(swin.layers[0].blocks[0].attn) is NormAwareLinearAttention
    assert 'layers.1.blocks.1.attn.qkvg.weight' in swin.state_dict()
    pvt = LinAttnPVT(dict(embed_dims=[16, 32, 48, 64], depths=[1, 1, 1, 1],
                          num_heads=[1, 2, 3, 4], mlp_ratios=[2, 2, 2, 2],
                          sr_ratios=[8, 4, 2, 1]), attn_cfg=nala).eval()
    assert not hasattr(pvt.block1[0].attn, 'sr')  # full-resolution keys/values
    small_swin = LinAttnSwin(dict(embed_dims=16, depths=[1, 1, 1, 1], num_heads=[1, 2, 2, 4]),
                             attn_cfg=[nala, nala, win, win]).eval()
    small_swin.init_weights()  # the mixer's own (official) LePE init after the skeleton's init
    lepe = small_swin.layers[1].blocks[0].attn.lepe
    assert 0.015 < lepe.weight.std().item() < 0.025 and (lepe.bias == 0).all()
    with torch.no_grad():
        for m, chans in ((pvt, [16, 32, 48, 64]), (small_swin, [16, 32, 64, 128])):
            outs = m(torch.randn(1, 3, 33, 47))
            assert [o.shape[1] for o in outs] == chans
            assert tuple(outs[0].shape[-2:]) == (9, 12)


@pytest.fixture(scope='module')
def tiny():
    torch.manual_seed(0)
    return NaLaFormer('t').eval()


@pytest.mark.parametrize('hw,grids', [((33, 47), [(9, 12), (5, 6), (3, 3), (2, 2)]),
                                      ((200, 334), [(50, 84), (25, 42), (13, 21), (7, 11)])])
def test_output_shapes_any_size(tiny, hw, grids):
    with torch.no_grad():
        outs = tiny(torch.randn(1, 3, *hw))
    assert [o.shape[1] for o in outs] == [64, 128, 256, 512]
    assert [tuple(o.shape[-2:]) for o in outs] == grids
    assert all(torch.isfinite(o).all() for o in outs)


def test_stage_types_options_and_errors():
    paper = dict(type='NormAwareLinearAttention', kernel='paper')
    m = NaLaFormer('xt', out_indices=(1, 3),
                   attn_cfg=[paper, paper, dict(type='NaLaSoftmaxAttention')] * 1
                   + [dict(type='NaLaSoftmaxAttention')])
    assert [type(s.blocks[0].attn).__name__ for s in m.layers] == [
        'NormAwareLinearAttention', 'NormAwareLinearAttention', 'NaLaSoftmaxAttention',
        'NaLaSoftmaxAttention']
    assert m.layers[0].blocks[0].attn.kernel == 'paper'
    assert set(m.extra_norms) == {'1', '3'}
    lin = NaLaFormer('xt', attn_cfg=dict(type='NormAwareLinearAttention'), out_indices=(3, ))
    assert all(type(s.blocks[-1].attn) is NormAwareLinearAttention for s in lin.layers)
    with torch.no_grad():
        assert [o.shape for o in lin.eval()(torch.randn(1, 3, 40, 40))] == [(1, 384, 2, 2)]
    assert NaLaFormer('b').layers[2].blocks[0].gamma_1.flatten()[0].item() == pytest.approx(1e-6)
    assert not hasattr(NaLaFormer('xt', layer_scale_init_values=0).layers[0].blocks[0], 'gamma_1')
    assert NaLaFormer('l').drop_path_rate == 0.55
    with pytest.raises(KeyError, match="unknown attention type 'linear'"):
        NaLaFormer('xt', attn_cfg=[dict(type='NormAwareLinearAttention'), dict(type='linear'),
                                   dict(type='NaLaSoftmaxAttention')] * 1
                   + [dict(type='NaLaSoftmaxAttention')])
    with pytest.raises(ValueError, match='attn_cfg has 2 entries'):
        NaLaFormer('xt', attn_cfg=[dict(type='NormAwareLinearAttention')] * 2)
    with pytest.raises(ValueError, match='nothing to return'):
        NaLaFormer('xt', out_indices=())
    with pytest.raises(KeyError, match='valid archs'):
        NaLaFormer('m')


def test_frozen_stages_norm_eval_and_with_cp():
    m = NaLaFormer('xt', frozen_stages=1, norm_eval=True)
    m.train()
    assert not any(p.requires_grad for p in m.patch_embed.parameters())
    assert not any(p.requires_grad for p in m.layers[0].parameters())
    assert all(p.requires_grad for p in m.layers[1].parameters())
    assert not m.layers[2].downsample.norm.training and m.layers[2].blocks[0].training
    torch.manual_seed(0)
    a = NaLaFormer('xt', drop_path_rate=0.)
    b = NaLaFormer('xt', drop_path_rate=0., with_cp=True)
    b.load_state_dict(a.state_dict())
    x = torch.randn(2, 3, 32, 32)
    sum(o.sum() for o in a(x)).backward()
    sum(o.sum() for o in b(x)).backward()
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=n)


@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
def test_backbone_autocast_large_inputs(dtype):
    torch.manual_seed(0)
    m = NaLaFormer('xt', num_classes=10).train()
    x = (torch.randn(2, 3, 48, 40) * 100).requires_grad_(True)
    with torch.autocast('cpu', dtype=dtype):
        outs = m(x)
    loss = sum(o.float().pow(2).mean() for o in outs)
    loss.backward()
    assert all(torch.isfinite(o).all() for o in outs)
    assert torch.isfinite(x.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in m.parameters() if p.grad is not None)


def test_registered_downstream():
    from mmdet.registry import MODELS as DET
    from mmpretrain.registry import MODELS as CLS
    from mmseg.registry import MODELS as SEG
    for reg in (DET, CLS, SEG):
        assert reg.get('NaLaFormer') is NaLaFormer


# ------------------------------------------------------------------------------------------------
# official checkpoints
# ------------------------------------------------------------------------------------------------
def official_keys(depths=(2, 2, 6, 2)):
    """State-dict keys of the official NALAFORMER_T, as listed in the spec (section 4)."""
    keys = []
    bn = ('weight', 'bias', 'running_mean', 'running_var', 'num_batches_tracked')
    for i in (0, 3, 6, 9):
        keys += [f'patch_embed.proj.{i}.weight', f'patch_embed.proj.{i}.bias']
    for i in (1, 4, 7, 10):
        keys += [f'patch_embed.proj.{i}.{k}' for k in bn]
    for s, depth in enumerate(depths):
        keys.append(f'layers.{s}.RoPE.angle')
        for j in range(depth):
            p = f'layers.{s}.blocks.{j}.'
            keys += [p + 'gamma_1', p + 'gamma_2']
            for mod in ('norm1.norm', 'norm2.norm', 'attn.qkvg', 'attn.lepe', 'attn.out_proj',
                        'attn.ln', 'ffn.fc1', 'ffn.fc2', 'ffn.dwconv', 'cpe1', 'cpe2'):
                keys += [p + mod + '.weight', p + mod + '.bias']
        if s < 3:
            keys += [f'layers.{s}.downsample.reduction.weight',
                     f'layers.{s}.downsample.reduction.bias']
            keys += [f'layers.{s}.downsample.norm.{k}' for k in bn]
    keys += ['proj.weight', 'proj.bias'] + [f'norm.{k}' for k in bn] + ['head.weight', 'head.bias']
    return set(keys)


def random_state(model, seed):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in model.state_dict().items():
        if k.endswith('RoPE.angle'):
            out[k] = v.clone()
        elif v.is_floating_point():
            out[k] = torch.randn(v.shape, generator=g) * 0.05 + (1. if 'running_var' in k else 0.)
        else:
            out[k] = v + 7
    return out


@pytest.fixture(scope='module')
def official_file(tmp_path_factory):
    ref = NaLaFormer('t', num_classes=1000, out_indices=())
    model, ema = random_state(ref, 1), random_state(ref, 2)
    path = tmp_path_factory.mktemp('ckpt') / 'nalaformer_t.pth'
    torch.save({'model': model, 'model_ema': ema, 'optimizer': {'state': {}}, 'epoch': 319,
                'scaler': {}, 'args': argparse.Namespace(model='NALAFORMER_T', lr=1e-3),
                'max_accuracy': 82.6}, path)
    return path, model, ema


def test_official_key_names():
    assert set(NaLaFormer('t', num_classes=1000, out_indices=()).state_dict()) == official_keys()


def test_official_file_into_classifier(official_file):
    path, model_sd, ema = official_file
    clf = linattn_mm.get_model('nalaformer-t_in1k', pretrained=str(path))
    rep = clf.load_report
    assert rep.source == 'model_ema'
    assert rep.unexpected == [] and rep.missing == []
    got = clf.backbone.state_dict()
    for k, v in ema.items():
        torch.testing.assert_close(got[k], v, msg=k)
    assert not torch.equal(got['head.weight'], model_sd['head.weight'])
    ref = NaLaFormer('t', num_classes=1000, out_indices=()).eval()
    ref.load_state_dict(ema)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        logits = clf(x, mode='tensor')
        want = ref(x)[-1]
    assert logits.shape == (2, 1000)
    torch.testing.assert_close(logits, want)


def test_official_file_into_dense_backbone(official_file):
    path, _, ema = official_file
    m = NaLaFormer('t', out_indices=(0, 1, 2, 3),
                   init_cfg=dict(type='Pretrained', checkpoint=str(path)))
    m.init_weights()
    rep = m.pretrained_load_report
    assert rep.source == 'model_ema' and rep.unexpected == []
    assert set(rep.missing) == {f'extra_norms.{i}.norm.{p}' for i in range(4)
                                for p in ('weight', 'bias')}
    assert {'proj.weight', 'norm.running_var', 'head.weight'} <= set(rep.dropped)
    got = m.state_dict()
    for k in ('layers.2.blocks.5.attn.qkvg.weight', 'patch_embed.proj.10.running_var',
              'layers.0.blocks.1.gamma_2', 'layers.3.blocks.1.ffn.dwconv.weight'):
        torch.testing.assert_close(got[k], ema[k])


@pytest.mark.parametrize('size', [224, 256])
def test_nalaformer_gives_other_mixers_the_stage_grid_at_the_pretraining_size(size):
    """Any mixer fits the NaLaFormer hierarchy: a mixer with size-dependent parameters (Pola's
    positional encoding, one row per token of the stage's grid at the pretraining resolution)
    gets the grid ``pretrain_img_size // 4 // 2**i`` of stage ``i`` and runs on any input."""
    m = NaLaFormer('xt', attn_cfg=dict(type='PolaLinearAttention'), pretrain_img_size=size)
    for i, stage in enumerate(m.layers):
        side = size // 4 // 2 ** i
        assert stage.blocks[0].attn.positional_encoding.shape == (1, side * side,
                                                                    m.embed_dims[i])
    outs = m(torch.randn(1, 3, 100, 148))
    assert [tuple(o.shape[-2:]) for o in outs] == [(25, 37), (13, 19), (7, 10), (4, 5)]
    sum(o.square().mean() for o in outs).backward()
    assert all(p.grad is not None for p in m.parameters())
