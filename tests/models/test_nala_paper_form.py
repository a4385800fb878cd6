"""NaLaFormer's switches for the paper's own form (no RoPE, no LePE, no CPE convs) and the constant
query power of the paper's Table 5 ablation, and the XT configs: the mixer against an oracle written
from the paper's equations (float64), the parameters each switch removes (counts pinned), the
backbone parameters of every XT config (pinned), and bad settings."""
import math

import pytest
import torch
import torch.nn.functional as F

from linattn_mm import deploy
from linattn_mm.apis import build_model
from linattn_mm.models.attentions.nala import NaLaSoftmaxAttention, NormAwareLinearAttention
from linattn_mm.models.backbones.nalaformer import NaLaFormer
from linattn_mm.ops.nala import nala_attention

PAPER = dict(type='NormAwareLinearAttention', kernel='paper', use_rope=False, use_lepe=False)


def n_params(m):
    return sum(p.numel() for p in m.parameters())


def randomise(module, scale=0.3):
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * scale)
    return module


# ------------------------------------------------------------------------------------------------
# oracles written from the paper (arXiv 2506.21137 v1, Eq. 8, 10-11, 16-17, App. A.2, Fig. 2a)
# ------------------------------------------------------------------------------------------------
def paper_similarity(q, k, lam=3., const_p=None):
    """(N, N) ``SM(q_i, k_j) = sum_t |d(q_i)_t|^p(||q_i||) |k_jt|^lam cos(f(d(q_i)_t) -
    f(d(k_j)_t))`` (Eq. 16-17 with the map ``f = pi/4 tanh`` of App. A.2, the cos of the difference
    written out), ``p(x) = lam (0.5 + tanh x)`` (Eq. 8) or the constant ``const_p``."""
    f = lambda t: math.pi / 4 * torch.tanh(t)  # noqa: E731
    qn, kn = q.norm(dim=1, keepdim=True), k.norm(dim=1, keepdim=True)
    dq, dk = q / qn, k / kn
    p = lam * (0.5 + torch.tanh(qn)) if const_p is None else torch.full_like(qn, const_p)
    N, M = q.shape[0], k.shape[0]
    S = torch.empty(N, M, dtype=q.dtype)
    for i in range(N):
        for j in range(M):
            S[i, j] = (dq[i].abs() ** p[i] * k[j].abs() ** lam *
                       torch.cos(f(dq[i]) - f(dk[j]))).sum()
    return S


def official_similarity(q, k, lam=3., const_p=None):
    """(N, N) similarity of the official sign split with the query power ``p``:
    ``sum_t relu(d(q)_t)^p relu(k_t^lam) + relu(-d(q)_t)^p relu(-k_t^lam)``."""
    qn = q.norm(dim=1, keepdim=True)
    dq = q / qn
    p = lam * (0.5 + torch.tanh(qn)) if const_p is None else torch.full_like(qn, const_p)
    kl = k.abs() ** lam * k.sign()
    return (dq.clamp(min=0) ** p) @ kl.clamp(min=0).T + ((-dq).clamp(min=0) ** p) @ \
        (-kl).clamp(min=0).T


def paper_layer(m, x, similarity, const_p=None):
    """The paper's block without RoPE and LePE: per head ``o_i = sum_j SM_ij v_j / sum_j SM_ij``
    (Eq. 10-11), then LayerNorm, the SiLU gate and the output projection ("simplified GLA",
    Fig. 2a)."""
    B, N, C = x.shape
    h = m.num_heads
    d = C // h
    outs = []
    for b in range(B):
        q, k, v, g = (x[b] @ m.qkvg.weight.T + m.qkvg.bias).split(C, dim=1)
        heads = []
        for i in range(h):
            sl = slice(i * d, (i + 1) * d)
            S = similarity(q[:, sl], k[:, sl], m.power, const_p)
            heads.append(S @ v[:, sl] / S.sum(1, keepdim=True))
        y = F.layer_norm(torch.cat(heads, 1), (C, ), m.ln.weight, m.ln.bias, m.ln.eps)
        y = y * g * torch.sigmoid(g)
        outs.append(y @ m.out_proj.weight.T + m.out_proj.bias)
    return torch.stack(outs)


# ------------------------------------------------------------------------------------------------
# the mixer
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize('core', ['fast', 'reference'])
@pytest.mark.parametrize('C,h,H,W', [(16, 2, 3, 5), (24, 3, 4, 4)])
def test_paper_form_equals_the_papers_equations(core, C, h, H, W):
    """kernel='paper' with RoPE and LePE off is the paper's layer (eps = 0: the paper's
    normaliser has none)."""
    torch.manual_seed(0)
    m = NormAwareLinearAttention(C, h, kernel='paper', use_rope=False, use_lepe=False, eps=0.,
                                 core=core)
    m = randomise(m).double().eval()
    x = torch.randn(2, H * W, C, dtype=torch.float64)
    torch.testing.assert_close(m(x, (H, W)), paper_layer(m, x, paper_similarity),
                               rtol=1e-10, atol=1e-10)
    # the default eps adds N * eps to the paper's sum: a relative change of that order only
    m.eps = 1e-6
    torch.testing.assert_close(m(x, (H, W)), paper_layer(m, x, paper_similarity),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize('core', ['fast', 'reference'])
@pytest.mark.parametrize('kernel,similarity', [('paper', paper_similarity),
                                               ('official', official_similarity)])
@pytest.mark.parametrize('c', [1., 2.5])
def test_constant_power_is_the_formula_with_that_constant(core, kernel, similarity, c):
    torch.manual_seed(1)
    C, h, H, W = 16, 2, 3, 4
    m = NormAwareLinearAttention(C, h, kernel=kernel, use_rope=False, use_lepe=False, eps=0.,
                                 query_power=c, core=core)
    m = randomise(m).double().eval()
    x = torch.randn(2, H * W, C, dtype=torch.float64)
    out = m(x, (H, W))
    torch.testing.assert_close(out, paper_layer(m, x, similarity, c), rtol=1e-10, atol=1e-10)
    # the norm-aware power gives another function
    assert (out - paper_layer(m, x, similarity)).abs().max() > 1e-3


@pytest.mark.parametrize('kernel', ['official', 'paper'])
def test_constant_power_cancels_the_query_norm(kernel):
    """With a constant power the query norm cancels (Eq. 5-6, the ablation's point): scaling the
    queries leaves the core unchanged; the norm-aware power does not."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 12, 8, generator=g, dtype=torch.float64) for _ in range(3))
    for core in ('fast', 'reference'):
        const = [nala_attention(s * q, k, v, 3., 1e-6, kernel=kernel, core=core, query_power=2.)
                 for s in (1., 3.)]
        torch.testing.assert_close(const[0], const[1], rtol=1e-12, atol=1e-12)
        aware = [nala_attention(s * q, k, v, 3., 1e-6, kernel=kernel, core=core)
                 for s in (1., 3.)]
        assert (aware[0] - aware[1]).abs().max() > 1e-3


def test_switch_defaults_keep_the_official_keys():
    m = NormAwareLinearAttention(32, 2)
    assert m.use_rope and m.use_lepe and m.query_power is None
    assert set(m.state_dict()) == {'qkvg.weight', 'qkvg.bias', 'lepe.weight', 'lepe.bias',
                                   'ln.weight', 'ln.bias', 'out_proj.weight', 'out_proj.bias'}


def test_turning_a_part_off_removes_exactly_its_parameters():
    # the mixer, C = 32: qkvg 32*128 + 128, lepe 5*5*32 + 32, ln 2*32, out_proj 32*32 + 32
    full, lean = NormAwareLinearAttention(32, 2), NormAwareLinearAttention(32, 2, use_lepe=False)
    assert (n_params(full), n_params(lean)) == (6176, 5344)
    assert set(full.state_dict()) - set(lean.state_dict()) == {'lepe.weight', 'lepe.bias'}
    assert lean.lepe is None
    assert n_params(NaLaSoftmaxAttention(32, 2, use_lepe=False)) == 5344
    # a constant power and RoPE off change no parameter
    assert n_params(NormAwareLinearAttention(32, 2, query_power=2., use_rope=False)) == 6176

    # the backbone, arch xt (dense): each CPE conv is 3*3*C + C per block, LePE 5*5*C + C per mixer
    ref = NaLaFormer('xt')
    keys = set(ref.state_dict())
    assert n_params(ref) == 4722176
    counts = {}
    for name, kw in [('no cpe', dict(use_cpe=False)), ('no cpe2', dict(use_cpe=(True, False))),
                     ('no cpe1', dict(use_cpe=[False, True])),
                     ('no lepe', dict(attn_cfg=dict(type='NormAwareLinearAttention',
                                                    use_lepe=False))),
                     ('paper form', dict(attn_cfg=PAPER, use_cpe=False))]:
        m = NaLaFormer('xt', **kw)
        counts[name] = n_params(m)
        gone = keys - set(m.state_dict())
        assert set(m.state_dict()) <= keys, name
        parts = {'no cpe': ('cpe1', 'cpe2'), 'no cpe2': ('cpe2', ), 'no cpe1': ('cpe1', ),
                 'no lepe': ('lepe', ), 'paper form': ('cpe1', 'cpe2', 'lepe', 'RoPE')}[name]
        assert gone and all(k.split('.')[-2] in parts for k in gone), (name, sorted(gone)[:4])
    assert counts == {'no cpe': 4697856, 'no cpe2': 4710016, 'no cpe1': 4710016,
                      'no lepe': 4690560, 'paper form': 4666240}
    # no RoPE anywhere: no stage RoPE buffer; the parameters stay
    m = NaLaFormer('xt', attn_cfg=[dict(type='NormAwareLinearAttention', use_rope=False),
                                   dict(type='NormAwareLinearAttention', use_rope=False),
                                   dict(type='NaLaSoftmaxAttention', use_rope=False),
                                   dict(type='NaLaSoftmaxAttention', use_rope=False)])
    assert n_params(m) == 4722176 and not any('RoPE' in k for k in m.state_dict())


def test_paper_form_backbone_runs_and_converts():
    """The paper's form trains (finite gradients) and keeps its outputs through the inference
    conversion (the new settings keep the plain mixer; the blocks without CPE convert)."""
    torch.manual_seed(0)
    m = NaLaFormer('xt', attn_cfg=dict(PAPER, query_power=2.), use_cpe=False).train()
    x = torch.randn(1, 3, 64, 64)
    sum(o.sum() for o in m(x)).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters())
    m.eval()
    with torch.no_grad():
        want = m(x)
        forms = deploy.converted_modules(deploy.convert(m))
        got = m(x)
    assert 'NaLaBlockCPU' in forms.values() and 'NormAwareLinearAttentionCPU' not in forms.values()
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('kw,match', [
    (dict(query_power=0), 'query_power must be None .* or a positive number, got 0'),
    (dict(query_power=-2.), 'query_power must be'),
    (dict(query_power='2'), 'query_power must be'),
    (dict(query_power=True), 'query_power must be'),
    (dict(query_power=2., core='triton'), 'constant query_power has no Triton core'),
])
def test_bad_query_power(kw, match):
    with pytest.raises(ValueError, match=match):
        NormAwareLinearAttention(16, 2, **kw)


@pytest.mark.parametrize('use_cpe', ['yes', (True, ), (True, 1), None])
def test_bad_use_cpe(use_cpe):
    with pytest.raises(ValueError, match='use_cpe must be a bool or a pair of bools'):
        NaLaFormer('xt', use_cpe=use_cpe)


# ------------------------------------------------------------------------------------------------
# the XT configs
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize('name,params', [
    ('nalaformer-xt_in1k', 6142248),  # the classifier: official proj / BN / 1x1 head included
    ('mask-rcnn_nalaformer-xt_fpn_1x_coco', 4722176),
    ('upernet_nalaformer-xt_8xb2-160k_ade20k-512x512', 4722176),
])
def test_xt_config_backbone_parameters(name, params):
    """Official XT widths (embed 32/64/128/384, depths 2/2/2/2, heads 1/2/4/12, mlp 3.5): 6.14M
    with the classifier where the official README says 8M."""
    backbone = build_model(name, pretrained_backbone=False).backbone
    assert type(backbone).__name__ == 'NaLaFormer'
    assert backbone.arch_settings['embed_dims'] == [32, 64, 128, 384]
    assert backbone.arch_settings['num_heads'] == [1, 2, 4, 12]
    assert n_params(backbone) == params
