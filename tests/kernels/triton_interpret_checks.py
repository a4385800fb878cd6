"""Run by tests/kernels/test_pola_triton.py and tests/kernels/test_nala_triton.py in a subprocess with
``TRITON_INTERPRET=1`` (Triton's interpreter runs the kernels on CPU tensors; the variable must be
set before the kernels are defined). Arguments: ``pola``, ``pola-grad`` (the Pola kernels'
backward: the gradients of the core, of modules and of a backbone), ``pola-fused`` (the same
gradients with the fused Pola core, :mod:`linattn_mm.ops.pola.fused`), ``nala`` and / or
``nala-grad`` and ``nala-fused`` (the same for NaLa), ``conv-fused`` (NaLaFormer blocks' conv
sums, :mod:`linattn_mm.ops.ffn.fused`), ``gate-fused`` (NaLa's gated output,
:mod:`linattn_mm.ops.nala.gate_fused`), ``rope-fused`` (the softmax stages' RoPE,
:mod:`linattn_mm.ops.nala.rope_fused`) (default ``pola`` and ``nala``). Prints one
JSON object: case name -> relative error against the float64 reference."""
import copy
import functools
import json
import sys

import torch

from linattn_mm import deploy
from linattn_mm.models.attentions.nala import NormAwareLinearAttention, RoPE2d
from linattn_mm.models.attentions.pola import PolaLinearAttention
from linattn_mm.models.backbones import LinAttnSwin
from linattn_mm.models.backbones.nalaformer import NaLaFormer
from linattn_mm.ops.dispatch import fused_launch
from linattn_mm.ops.nala import nala_attention
from linattn_mm.ops.nala.fused import nala_attention_fused
from linattn_mm.ops.nala.triton import nala_attention_triton
from linattn_mm.ops.pola.reference import polarity_attention_reference as polarity_attention
from linattn_mm.ops.pola.fused import polarity_attention_fused
from linattn_mm.ops.pola.triton import polarity_attention_triton
from oracles.nala import nala_reference_core


def rel(got, want):
    got, want = got.double(), want.double()
    return ((got - want).abs().max() / want.abs().max()).item()


def triton_vs_reference(net, mixer_cls, *inputs):
    """Relative error of ``net`` converted for CUDA (:func:`linattn_mm.deploy.convert`: every
    ``mixer_cls`` on the Triton core, float32) against the same net with the mixers' reference
    cores in float64 (the largest over tuple outputs)."""
    mixers = [m for m in net.modules() if isinstance(m, mixer_cls)]
    assert mixers
    with torch.no_grad():
        for m in mixers:
            m.core = 'reference'
        want = net.double()(*(t.double() if torch.is_tensor(t) else t for t in inputs))
        for m in mixers:
            m.core = 'fast'
        deploy.convert(net.float(), 'cuda')
        assert all(m.core == 'triton' and isinstance(m, deploy.InferenceForm) for m in mixers)
        got = net(*inputs)
    if torch.is_tensor(got):
        return rel(got, want)
    return max(rel(a, b) for a, b in zip(got, want))


def core_cases():
    """(name, B, h, N, n, d, position encoding, temperature, input dtype)."""
    return [('fp32 d32 pe scale', 2, 3, 70, 70, 32, True, True, torch.float32),
            ('fp32 odd d7 n<N no pe', 1, 2, 33, 17, 7, False, True, torch.float32),
            ('fp32 d64 one head no scale', 1, 1, 129, 129, 64, True, False, torch.float32),
            ('fp32 d8 several key chunks', 1, 1, 40, 300, 8, True, True, torch.float32),
            ('bf16 d16', 2, 2, 50, 50, 16, True, True, torch.bfloat16),
            ('fp16 d16', 1, 2, 50, 50, 16, True, True, torch.float16)]


def _pola_inputs(case, seed):
    """Leaf tensors q, k, v, p, s, bias (bias None without position encoding) of a core case."""
    name, B, h, N, n, d, pe, sc, dt = case
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, N, h * 4 * d, generator=g)[..., ::4]  # strided, like an unbind view
    q = q.reshape(B, N, h, d).transpose(1, 2)
    k, v = (torch.randn(B, h, n, d, generator=g) for _ in range(2))
    p = 1 + 4 * torch.rand(1, h, 1, d, generator=g)
    s = 0.5 + torch.rand(1, h, 1, d, generator=g)
    bias = 0.3 * torch.randn(1, h, n, d, generator=g) if pe else None
    q, k, v = q.to(dt), k.to(dt), v.to(dt)
    bias = bias.to(dt) if pe else None
    grad = torch.randn(B, h, N, d, generator=g)
    return [q, k, v, p, s, bias], grad


def _pola_reference(q, k, v, p, s, bias, scale):
    """The float64 reference core (the official order of operations) on float64 inputs: the
    position encoding ``bias`` (or None) added to k, then q and k divided by ``s`` if ``scale``."""
    if bias is not None:
        k = k + bias
    if scale:
        q, k = q / s, k / s
    return polarity_attention(q, k, v, p, 1e-6)


def run_core(res):
    for case in core_cases():
        name, B, h, N, _, d, _, sc, _ = case
        (q, k, v, p, s, bias), _ = _pola_inputs(case, len(res))
        out = polarity_attention_triton(q, k, v, p, 1e-6, temperature=s if sc else None,
                                        k_bias=bias, out_dtype=torch.float32)
        assert out.shape == (B, h, N, d) and out.transpose(1, 2).is_contiguous()
        # reference: in float64 on the same (rounded) inputs
        res[name] = rel(out, _pola_reference(*(None if t is None else t.double()
                                               for t in (q, k, v, p, s, bias)), sc))


def randomise_pola_(m, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, prm in m.named_parameters():
            if name.split('.')[-1] in ('power', 'scale', 'positional_encoding'):
                prm.copy_(0.5 * torch.randn(prm.shape, generator=g))


#: (name, options, class tokens, grid) of the Pola module checks
POLA_MODULE_CASES = [('qkvg', dict(qkv_layout='qkvg'), 0, (11, 13)),
                     ('qg_kv la_sr 2', dict(la_sr_ratio=2), 0, (12, 9)),
                     ('static gate, class token', dict(qkv_layout='qkvg', gate='static'), 1,
                      (7, 7)),
                     ('polarity only', dict(gate='none', use_dwc=False), 0, (9, 10))]


def pola_modules(train):
    """(name, seeded module with non-trivial parameters, input, grid) per Pola module case."""
    for i, (name, kw, e, hw) in enumerate(POLA_MODULE_CASES):
        torch.manual_seed(i)
        m = PolaLinearAttention(32, 4, pretrain_hw=(8, 8), num_extra_tokens=e, **kw)
        randomise_pola_(m, i)
        yield name, m.train(train), torch.randn(2, e + hw[0] * hw[1], 32), hw


def pola_swin(**kwargs):
    """A small seeded Pola-Swin backbone (global Pola in stages 1-2, window-7 stages 3-4) with
    non-trivial Pola parameters; ``kwargs`` go to the backbone."""
    torch.manual_seed(0)
    net = LinAttnSwin(arch=dict(embed_dims=32, depths=[1, 1, 1, 1], num_heads=[1, 2, 4, 8]),
                      attn_cfg=[dict(type='PolaLinearAttention', qkv_layout='qkvg')] * 2 + [
                          dict(type='WindowSoftmaxAttention', window_size=7)] * 2, **kwargs)
    randomise_pola_(net, 7)
    return net


def run_modules(res):
    for name, m, x, hw in pola_modules(train=False):
        res[f'module {name}'] = triton_vs_reference(m, PolaLinearAttention, x, hw)
    # a whole Pola-Swin backbone (global Pola in stages 1-2), every mixer on the Triton core
    net = pola_swin().eval()
    res['Pola-Swin backbone'] = triton_vs_reference(net, PolaLinearAttention,
                                                    torch.randn(1, 3, 64, 96))


def run_core_grads(res, fused=False):
    """The Triton forward and backward of the core (``fused``: the fused core) against plain
    autograd of the float64 reference on the same (rounded) inputs: the output and the gradient
    of every input (q, k, v and the position encoding in their dtype, p and the temperature in
    float32)."""
    for i, case in enumerate(core_cases()):
        name, sc = case[0], case[7]
        leaves, grad = _pola_inputs(case, 100 + i)
        leaves = [t.requires_grad_() if t is not None else None for t in leaves]
        q, k, v, p, s, bias = leaves
        kw = dict(temperature=s if sc else None, k_bias=bias)
        if fused:
            out = polarity_attention_fused(q, k, v, p, 1e-6, **kw)
            assert out.dtype == torch.float32
        else:
            out = polarity_attention_triton(q, k, v, p, 1e-6, out_dtype=torch.float32, **kw)
        names = ('q', 'k', 'v', 'p', 'temperature', 'pe')
        idx = [j for j, t in enumerate(leaves) if t is not None and (sc or j != 4)]
        got = torch.autograd.grad(out, [leaves[j] for j in idx], grad)
        ref = [t.detach().double().requires_grad_() if t is not None else None for t in leaves]
        want_out = _pola_reference(*ref, sc)
        want = torch.autograd.grad(want_out, [ref[j] for j in idx], grad.double())
        res[f'grad {name}: out'] = rel(out, want_out)
        for j, a, b in zip(idx, got, want):
            assert a.dtype == leaves[j].dtype and a.shape == leaves[j].shape, names[j]
            res[f'grad {name}: {names[j]}'] = rel(a, b)
        if fused:  # the result in a half dtype against the float32 result rounded, the
            # gradients of a half-precision gradient against those of its values in float32
            half = leaves[0].dtype if leaves[0].dtype != torch.float32 else torch.bfloat16
            g_half = grad.to(half)
            out_h = polarity_attention_fused(q, k, v, p, 1e-6, **kw, out_dtype=half)
            out_f = polarity_attention_fused(q, k, v, p, 1e-6, **kw)
            assert out_h.dtype == half and out_h.stride() == out_f.stride()
            diff = (out_h.float() - out_f.to(half).float()).abs().max()
            res[f'outdtype {name}: out'] = diff.item()
            got_h = torch.autograd.grad(out_h, [leaves[j] for j in idx], g_half)
            got_f = torch.autograd.grad(out_f, [leaves[j] for j in idx], g_half.float())
            for j, a, b in zip(idx, got_h, got_f):
                diff = (a.double() - b.double()).abs().max()
                res[f'outdtype {name}: {names[j]}'] = diff.item()


def loss_weights(outs):
    """The fixed random tensors (float32, on CPU) the checks' training steps multiply their
    outputs by: the loss is ``sum((out * w).sum())``."""
    g = torch.Generator().manual_seed(0)
    return [torch.randn(o.shape, generator=g) for o in outs]


def train_vs_reference(net, mixer_cls, *inputs, core='triton'):
    """Largest relative error over the output, the input's gradient and every parameter's
    gradient of a training step of ``net`` (float32, every ``mixer_cls`` on ``core``, the Triton
    core by default) against a float64 copy on the reference cores (loss: the outputs times fixed
    random tensors)."""
    ref = copy.deepcopy(net).double()
    for m in net.modules():
        if isinstance(m, mixer_cls):
            m.core = core
    for m in ref.modules():
        if isinstance(m, mixer_cls):
            m.core = 'reference'
        if getattr(m, 'ffn_core', None) == 'fused':  # NaLaFormer blocks: their plain modules
            m.ffn_core = 'reference'
        if getattr(m, 'gate_core', None) == 'fused':  # NaLa mixers' gated output: torch's
            m.gate_core = 'fast'
    errs = []
    weights = None
    for model, cast in ((net, torch.float32), (ref, torch.float64)):
        x = inputs[0].detach().to(cast).requires_grad_()
        outs = model(x, *inputs[1:])
        outs = [outs] if torch.is_tensor(outs) else list(outs)
        if weights is None:
            weights = loss_weights(outs)
        loss = sum((o * w.to(o.device, cast)).sum() for o, w in zip(outs, weights))
        loss.backward()
        errs.append((outs, x.grad, {k: p.grad for k, p in model.named_parameters()
                                    if p.grad is not None}))
    (o32, x32, p32), (o64, x64, p64) = errs
    assert set(p32) == set(p64) and p32, 'the same parameters get gradients'
    worst = max(rel(a, b) for a, b in zip(o32, o64))
    worst = max(worst, rel(x32, x64), *(rel(p32[k], p64[k]) for k in p64))
    return worst


def run_module_grads(res, core='triton'):
    """Training steps of Pola modules and of a Pola-Swin backbone on the Triton core (or
    ``core``)."""
    for name, m, x, hw in pola_modules(train=True):
        res[f'train module {name}'] = train_vs_reference(m, PolaLinearAttention, x, hw, core=core)
    net = pola_swin(with_cp=True, drop_path_rate=0.).train()
    res['train Pola-Swin backbone, with_cp'] = train_vs_reference(
        net, PolaLinearAttention, torch.randn(2, 3, 64, 96), core=core)


def nala_cases():
    """(name, B, h, (H, W), d, RoPE, lam, input dtype)."""
    return [('nala fp32 d32 rope', 2, 3, (7, 10), 32, True, 3., torch.float32),
            ('nala fp32 d16 no rope', 1, 2, (5, 7), 16, False, 3., torch.float32),
            ('nala fp32 d12 rope (padded head dim)', 1, 2, (6, 6), 12, True, 3., torch.float32),
            ('nala fp32 d64 rope (NaLaFormer head)', 1, 1, (6, 8), 64, True, 3., torch.float32),
            ('nala fp32 lam 2 rope', 1, 1, (8, 9), 8, True, 2., torch.float32),
            ('nala fp32 d8 several key chunks', 1, 1, (15, 20), 8, True, 3., torch.float32),
            ('nala bf16 d16 rope', 2, 2, (7, 7), 16, True, 3., torch.bfloat16),
            ('nala fp16 d16 rope', 1, 2, (7, 7), 16, True, 3., torch.float16)]


def run_nala(res):
    for name, B, h, hw, d, rope, lam, dt in nala_cases():
        g = torch.Generator().manual_seed(len(res))
        N = hw[0] * hw[1]
        q = torch.randn(B, N, h * 4 * d, generator=g)[..., 1::4]  # strided, like an unbind view
        q = q.reshape(B, N, h, d).transpose(1, 2)
        k, v = (torch.randn(B, h, N, d, generator=g) for _ in range(2))
        k = 0.7 * k
        q, k, v = q.to(dt), k.to(dt), v.to(dt)
        sin, cos = RoPE2d(d)(hw) if rope else (None, None)
        out = nala_attention_triton(q, k, v, lam, 1e-6, sin, cos, out_dtype=torch.float32)
        assert out.shape == (B, h, N, d) and out.transpose(1, 2).is_contiguous()
        rope = None if sin is None else (sin.double(), cos.double())
        res[name] = rel(out, nala_reference_core(q.double(), k.double(), v.double(), lam, 1e-6,
                                                 rope))
    for i, (name, kw, hw) in enumerate([('nala module rope', {}, (11, 13)),
                                        ('nala module no rope, lam 2',
                                         dict(use_rope=False, power=2.), (6, 9))]):
        torch.manual_seed(i)
        m = NormAwareLinearAttention(32, 2, **kw).eval()
        x = torch.randn(2, hw[0] * hw[1], 32)
        res[name] = triton_vs_reference(m, NormAwareLinearAttention, x, hw)
    # the native NaLaFormer hierarchy with NaLa in every stage, every mixer on the Triton core
    torch.manual_seed(0)
    net = NaLaFormer(arch=dict(embed_dims=[16, 32, 32, 32], depths=[1, 1, 1, 1],
                               num_heads=[1, 2, 2, 2], mlp_ratios=[2, 2, 2, 2]),
                     attn_cfg=dict(type='NormAwareLinearAttention')).eval()
    res['NaLaFormer backbone'] = triton_vs_reference(net, NormAwareLinearAttention,
                                                     torch.randn(1, 3, 64, 96))



def _nala_core(fused):
    """The NaLa Triton core (float32 output), or the fused core."""
    if fused:
        return nala_attention_fused
    return functools.partial(nala_attention_triton, out_dtype=torch.float32)


def nala_in_situ(net, x, core):
    """The NaLa core calls of a float32 training step of ``net`` (every mixer on the torch core,
    activation checkpointing off), each on its own inputs and the gradient its output got: per
    call, the largest relative error over the output and the gradients of q, k, v against the
    float64 oracle on the same inputs, for ``core`` (``'triton'`` or ``'fused'``), the torch core
    (``'fast'``) and the float32 reference core. A list of dicts, one per call, in order."""
    import linattn_mm.models.attentions.nala as nala_module
    net = copy.deepcopy(net)
    for m in net.modules():
        if isinstance(m, NormAwareLinearAttention):
            m.core = 'fast'
        if hasattr(m, 'with_cp'):
            m.with_cp = False
    calls, run = [], nala_module.nala_attention

    def capture(q, k, v, power, eps, sin, cos, *args, **kwargs):
        out = run(q, k, v, power, eps, sin, cos, *args, **kwargs)
        call = dict(args=[t.detach().clone() for t in (q, k, v)], power=power, eps=eps,
                    rope=None if sin is None else (sin.detach(), cos.detach()))
        out.register_hook(lambda g: call.update(grad=g.detach().clone()))
        calls.append(call)
        return out

    nala_module.nala_attention = capture
    try:
        outs = net(x.clone().requires_grad_())
    finally:
        nala_module.nala_attention = run
    sum((o * w).sum() for o, w in zip(outs, loss_weights(outs))).backward()
    found = []
    for call in calls:
        ref = [t.double().requires_grad_() for t in call['args']]
        rope = call['rope'] and tuple(t.double() for t in call['rope'])
        want = nala_reference_core(*ref, call['power'], call['eps'], rope)
        want = [want.detach(), *torch.autograd.grad(want, ref, call['grad'].double())]
        errs = {}
        for name in (core, 'fast', 'reference'):
            leaves = [t.clone().requires_grad_() for t in call['args']]
            sin, cos = call['rope'] or (None, None)
            out = nala_attention(*leaves, call['power'], call['eps'], sin, cos, core=name)
            got = [out.detach(), *torch.autograd.grad(out, leaves, call['grad'])]
            errs[name] = max(rel(a, b) for a, b in zip(got, want))
        found.append(errs)
    return found


def run_nala_grads(res, fused=False):
    """The NaLa Triton forward and backward (``fused``: the fused core's) against plain autograd
    of the float64 reference core on the same (rounded) inputs (q, k, v get their gradients in
    their dtype), then training steps of modules and of a NaLaFormer with NaLa in every stage."""
    core = _nala_core(fused)
    for i, (name, B, h, hw, d, rope, lam, dt) in enumerate(nala_cases()):
        g = torch.Generator().manual_seed(200 + i)
        N = hw[0] * hw[1]
        q = torch.randn(B, N, h * 4 * d, generator=g)[..., 1::4]  # strided, like an unbind view
        q = q.reshape(B, N, h, d).transpose(1, 2)
        k, v = (torch.randn(B, h, N, d, generator=g) for _ in range(2))
        leaves = [t.to(dt).requires_grad_() for t in (q, 0.7 * k, v)]
        grad = torch.randn(B, h, N, d, generator=g)
        sin, cos = RoPE2d(d)(hw) if rope else (None, None)
        out = core(*leaves, lam, 1e-6, sin, cos)
        assert out.dtype == torch.float32
        got = torch.autograd.grad(out, leaves, grad)
        ref = [t.detach().double().requires_grad_() for t in leaves]
        table = None if sin is None else (sin.double(), cos.double())
        want_out = nala_reference_core(*ref, lam, 1e-6, table)
        want = torch.autograd.grad(want_out, ref, grad.double())
        res[f'grad {name}: out'] = rel(out, want_out)
        for nm, a, b, leaf in zip('qkv', got, want, leaves):
            assert a.dtype == leaf.dtype and a.shape == leaf.shape, nm
            res[f'grad {name}: {nm}'] = rel(a, b)
    if fused:  # another launch of the fused kernels (dispatch.fused_launch): 8 warps, tiles of
        # 512 elements (32 tokens at d = 16 instead of 128), a float32 case with the RoPE
        g = torch.Generator().manual_seed(250)
        B, h, hw, d = 2, 2, (9, 7), 16
        leaves = [torch.randn(B, h, 63, d, generator=g).requires_grad_() for _ in range(3)]
        grad = torch.randn(B, h, 63, d, generator=g)
        sin, cos = RoPE2d(d)(hw)
        with fused_launch(8, 512):
            out = core(*leaves, 3., 1e-6, sin, cos)
            got = torch.autograd.grad(out, leaves, grad)
        ref = [t.detach().double().requires_grad_() for t in leaves]
        want_out = nala_reference_core(*ref, 3., 1e-6, (sin.double(), cos.double()))
        want = torch.autograd.grad(want_out, ref, grad.double())
        res['launch 8 warps, 512 elements: out'] = rel(out, want_out)
        for nm, a, b in zip('qkv', got, want):
            res[f'launch 8 warps, 512 elements: {nm}'] = rel(a, b)
    # v_keep: the kernels read the half-precision projection v was cast from, and keep it; v
    # still gets its gradient in float32: the same values as reading the float32 v
    g = torch.Generator().manual_seed(300)
    B, h, hw, d = 2, 2, (7, 9), 16
    q, k = (torch.randn(B, h, hw[0] * hw[1], d, generator=g).requires_grad_() for _ in range(2))
    v_low = torch.randn(B, h, hw[0] * hw[1], d, generator=g).bfloat16().requires_grad_()
    grad = torch.randn(B, h, hw[0] * hw[1], d, generator=g)
    sin, cos = RoPE2d(d)(hw)
    runs = []
    for keep in (False, True):
        v = v_low.float()
        out = core(q, k, v, 3., 1e-6, sin, cos, v_keep=v_low if keep else None)
        kept = out.grad_fn.saved_tensors if keep else ()
        runs.append([out, *torch.autograd.grad(out, (q, k, v), grad)])
    assert any(t.dtype == torch.bfloat16 and t.data_ptr() == v_low.data_ptr() for t in kept), \
        'v_keep is what the Function keeps'
    assert runs[1][3].dtype == torch.float32
    res['v_keep: largest difference to reading v (out, dq, dk, dv)'] = max(
        (a - b).abs().max().item() for a, b in zip(*runs))
    for i, (name, kw, hw) in enumerate([('train nala module rope', {}, (11, 13)),
                                        ('train nala module no rope, lam 2',
                                         dict(use_rope=False, power=2.), (6, 9))]):
        torch.manual_seed(i)
        m = NormAwareLinearAttention(32, 2, **kw).train()
        res[name] = train_vs_reference(m, NormAwareLinearAttention,
                                       torch.randn(2, hw[0] * hw[1], 32), hw,
                                       core='fused' if fused else 'triton')
    torch.manual_seed(0)
    net = NaLaFormer(arch=dict(embed_dims=[16, 32, 32, 32], depths=[1, 1, 1, 1],
                               num_heads=[1, 2, 2, 2], mlp_ratios=[2, 2, 2, 2]),
                     attn_cfg=dict(type='NormAwareLinearAttention'), with_cp=True,
                     drop_path_rate=0., norm_eval=True).train()  # BN: running statistics (in
    # training mode a bias before a BN has no gradient, 0 against float rounding)
    x = torch.randn(2, 3, 64, 96)
    # the float32 error of the whole network with the default torch core, the baseline of the
    # Triton core's (a LayerNorm or bias gradient summed over the tokens meets 1e-5 either way)
    res['train NaLaFormer backbone, with_cp, torch core (baseline)'] = train_vs_reference(
        copy.deepcopy(net), NormAwareLinearAttention, x, core='fast')
    res['train NaLaFormer backbone, with_cp'] = train_vs_reference(
        net, NormAwareLinearAttention, x, core='fused' if fused else 'triton')
    # the same step's NaLa core calls, each on its own inputs and upstream gradient
    for i, errs in enumerate(nala_in_situ(net, x, 'fused' if fused else 'triton')):
        for name, err in errs.items():
            res[f'in situ call {i}: {name}'] = err


def _shifted_sum(x, w, flip=False):
    """float64 ``sum_ij w[c, 0, i, j] x[b, y + i - K//2, x + j - K//2, c]`` of a (B, H, W, C) map
    (zeros outside; the kernel flipped with ``flip``), written out tap by tap."""
    B, H, W, C = x.shape
    K = w.shape[-1]
    P = K // 2
    pad = torch.zeros(B, H + 2 * P, W + 2 * P, C, dtype=torch.float64)
    pad[:, P:P + H, P:P + W] = x.double()
    out = torch.zeros(B, H, W, C, dtype=torch.float64)
    for i in range(K):
        for j in range(K):
            wi, wj = (K - 1 - i, K - 1 - j) if flip else (i, j)
            out += pad[:, i:i + H, j:j + W] * w[:, 0, wi, wj].double()
    return out


def _gelu_grad64(p):
    p = p.double()
    return 0.5 * (1 + torch.erf(p / 2 ** 0.5)) + p * torch.exp(-p * p / 2) / (2 * torch.pi) ** 0.5


def run_conv_sums(res):
    """NaLaFormer blocks' conv sums (linattn_mm.ops.ffn.fused): the kernel against the formula;
    the ConvFFN and CPE Functions' gradients against plain autograd of the modules in float64;
    under bf16 autocast against the blocks' default form; whole NaLaFormers on the fused blocks
    and the fused NaLa core against the float64 reference."""
    from linattn_mm.models.attentions.nala import set_fused_gates, set_fused_rope
    from linattn_mm.models.backbones.nalaformer import ConvFFN, NaLaBlock, set_fused_blocks
    from linattn_mm.ops.ffn.fused import ConvResidualFused, conv_ffn_branch_fused, conv_sum
    g = torch.Generator().manual_seed(7)
    # the kernel: channels-last and NCHW maps, K 3 and 5, bias or none, flipped, times gelu'
    for layout in ('nhwc', 'nchw'):
        for K, bias, flip, gelu, W, C in ((3, True, False, False, 19, 21),
                                          (3, False, True, True, 150, 300),
                                          (5, True, True, False, 70, 9)):
            B, H = 2, 7  # maps of one tile, of several along the row and across the channels
            x = torch.randn(B, H, W, C, generator=g)
            if layout == 'nchw':
                x = torch.randn(B, C, H, W, generator=g).permute(0, 2, 3, 1)
            w = torch.randn(C, 1, K, K, generator=g)
            b = torch.randn(C, generator=g) if bias else None
            pre = torch.randn(B, H, W, C, generator=g) if gelu else None
            z = conv_sum(x, w, b, pre=pre, flip=flip)
            assert z.stride() == x.stride() and z.dtype == torch.float32
            want = x.double() + _shifted_sum(x, w, flip)
            if bias:
                want = want + b.double()
            if gelu:
                want = want * _gelu_grad64(pre)
            res[f'conv_sum {layout} K{K} bias={bias} flip={flip} gelu={gelu}'] = rel(z, want)
    # in bf16 (the conv as autocast runs it): the two roundings of conv2d + add; a float32 map
    # (the CPE's) with the conv in bf16 and the sum in float32, and its bf16 copy
    x = torch.randn(2, 9, 11, 24, generator=g)
    w, b = torch.randn(24, 1, 3, 3, generator=g), torch.randn(24, generator=g)
    for name, inp, out_dtype in (('bf16 map', x.bfloat16(), torch.bfloat16),
                                 ('fp32 map, bf16 conv', x, torch.float32)):
        z, copy_ = conv_sum(inp, w, b, conv_dtype=torch.bfloat16, out_dtype=out_dtype, copy=True)
        xb = inp.bfloat16()
        conv = (_shifted_sum(xb, w.bfloat16()) + b.bfloat16().double()).float().bfloat16()
        want = (inp.double() + conv.double()).to(out_dtype)
        assert z.dtype == out_dtype and copy_.dtype == torch.bfloat16
        res[f'conv_sum {name}: elements off its rounding'] = (z != want).float().mean().item()
        diff = (z.double() - want.double()).abs()
        res[f'conv_sum {name}: largest difference (ulps)'] = torch.where(
            diff == 0, 0., diff / (want.double().abs() * 2 ** -8)).max().item()
        res[f'conv_sum {name}: copy differences'] = (copy_ != xb).sum().item()

    # NaN stays NaN through the bf16 rounding (torch's cast keeps it; the rounding on the bits
    # would make the quiet NaN 0x7fffffff -0.0): a float32 map with NaNs, the conv in bf16
    x = torch.randn(1, 5, 6, 16, generator=g)
    x.view(-1)[[3, 40, 77]] = torch.tensor([0x7FFFFFFF, 0x7F800001, -1], dtype=torch.int32).view(
        torch.float32)
    z, copy_ = conv_sum(x, w[:16], b[:16], conv_dtype=torch.bfloat16, out_dtype=torch.float32,
                        copy=True)
    want = x + torch.nn.functional.conv2d(
        x.bfloat16().permute(0, 3, 1, 2), w[:16].bfloat16(), b[:16].bfloat16(), 1, 1, 1,
        16).permute(0, 2, 3, 1)
    res['conv_sum NaN: places that differ from the plain form'] = (
        z.isnan() != want.isnan()).sum().item() + (copy_.isnan() != x.isnan()).sum().item()
    res['conv_sum NaN: NaNs in the sum'] = z.isnan().sum().item()

    # the residual sums' backward (ScaledAddFused): x + b * f with a layer scale (1, C, 1, 1)
    # or a per-image factor (B, C, 1, 1); b channels-last (a mixer's output) or NCHW, float32 or
    # bf16 (the sum then float32); one chunk of tokens, or many
    from linattn_mm.ops.ffn.fused import ScaledAddFused
    def layout(kind, B, C, H, W):
        """A (B, C, H, W) map: channels-last, NCHW, H and W transposed (they do not merge), or
        with W = 1 a slice of a (2B, C, 1, H) map transposed (strides (C H, H, 1, H))."""
        if kind == 'channels-last':
            return torch.randn(B, H, W, C, generator=g).permute(0, 3, 1, 2)
        if kind == 'hw-transposed':
            return torch.randn(B, C, W, H, generator=g).transpose(2, 3)
        if kind == 'w1-slice':
            return torch.randn(2 * B, C, W, H, generator=g).transpose(2, 3)[:B]
        return torch.randn(B, C, H, W, generator=g)

    for name, (B, C, H, W), per_image, dtype, b_kind, g_kind in (
            ('scale fp32', (2, 24, 5, 7), False, torch.float32, 'channels-last', 'nchw'),
            ('per-image bf16', (3, 20, 6, 9), True, torch.bfloat16, 'channels-last', 'nchw'),
            ('scale fp32, many chunks', (1, 16, 64, 64), False, torch.float32, 'nchw', 'nchw'),
            ('scale fp32, H and W transposed', (2, 18, 5, 7), False, torch.float32,
             'hw-transposed', 'hw-transposed'),
            ('per-image fp32, W = 1 slices', (2, 20, 9, 1), True, torch.float32, 'w1-slice',
             'w1-slice')):
        x = torch.randn(B, C, H, W, generator=g, requires_grad=True)
        b = layout(b_kind, B, C, H, W).to(dtype).requires_grad_()
        f = torch.randn(B if per_image else 1, C, 1, 1, generator=g, requires_grad=True)
        grad = layout(g_kind, B, C, H, W)
        out = ScaledAddFused.apply(x, b, f, torch.float32)
        got = [out, *torch.autograd.grad(out, (x, b, f), grad)]
        assert got[2].dtype == dtype, name
        f64 = f.detach().double()
        want = [x.double() + b.double() * f64, grad.double(), grad.double() * f64,
                (grad.double() * b.double()).sum((0, 2, 3) if not per_image else (2, 3),
                                                  keepdim=True).view(f.shape)]
        res[f'ScaledAddFused {name}: out and every gradient'] = max(
            rel(a, w) for a, w in zip(got, want))

    def step(fn, leaves, grad):
        out = fn(*leaves)
        return [out, *torch.autograd.grad(out, [t for t in leaves if t.requires_grad], grad)]

    # the ConvFFN branch (B, H, W, C) against its modules in float64
    torch.manual_seed(1)
    for i, (H, W, C) in enumerate(((6, 9, 8), (5, 13, 12))):
        ffn = ConvFFN(C, 4 * C)
        norm = torch.nn.LayerNorm(C)
        with torch.no_grad():
            for p in (*ffn.parameters(), *norm.parameters()):
                p.add_(0.3 * torch.randn(p.shape, generator=g))
        x = torch.randn(2, H, W, C, generator=g, requires_grad=True)
        grad = torch.randn(2, H, W, C, generator=g)
        params = [x, *norm.parameters(), *ffn.parameters()]
        got = step(lambda *a: conv_ffn_branch_fused(x, norm, ffn), params, grad)
        ffn64, norm64 = copy.deepcopy(ffn).double(), copy.deepcopy(norm).double()
        x64 = x.detach().double().requires_grad_()
        want = step(lambda *a: ffn64(norm64(x64).permute(0, 3, 1, 2)).permute(0, 2, 3, 1),
                    [x64, *norm64.parameters(), *ffn64.parameters()], grad.double())
        res[f'ConvFFN fused {H}x{W}x{C}: out and every gradient'] = max(
            rel(a, b) for a, b in zip(got, want))
        # the CPE x + dwconv(x) on an NCHW map
        conv = torch.nn.Conv2d(C, C, 3, 1, 1, groups=C)
        xc = torch.randn(2, C, H, W, generator=g, requires_grad=True)
        grad = torch.randn(2, C, H, W, generator=g)
        got = step(lambda *a: ConvResidualFused.apply(xc, conv.weight, conv.bias, torch.float32),
                   [xc, conv.weight, conv.bias], grad)
        conv64 = copy.deepcopy(conv).double()
        x64 = xc.detach().double().requires_grad_()
        want = step(lambda *a: x64 + conv64(x64), [x64, *conv64.parameters()], grad.double())
        res[f'CPE fused {H}x{W}x{C}: out and every gradient'] = max(
            rel(a, b) for a, b in zip(got, want))
    # a NaLaFormer block under bf16 autocast: the fused conv sums against the default form
    torch.manual_seed(2)
    blk = NaLaBlock(16, 4, dict(type='NormAwareLinearAttention'), layer_scale_init_value=0.7)
    with torch.no_grad():
        for name, p in blk.named_parameters():
            if 'bias' in name or 'cpe' in name or 'dwconv' in name:
                p.normal_(0, 0.3, generator=g)
    x = torch.randn(2, 16, 7, 9, generator=g)
    grad = torch.randn(2, 16, 7, 9, generator=g)
    runs = {}
    for core in ('fast', 'fused'):
        blk.ffn_core = core
        xi = x.clone().requires_grad_()
        with torch.autocast('cpu', dtype=torch.bfloat16):
            out = blk(xi)
        runs[core] = dict(out=out, **dict(zip(
            ['x'] + [n for n, _ in blk.named_parameters()],
            torch.autograd.grad(out, [xi, *blk.parameters()], grad))))
    fast, fused = runs['fast'], runs['fused']
    # stochastic depth (the same masks: the same seed), float32
    dp = NaLaBlock(16, 4, dict(type='NormAwareLinearAttention'), drop_path=0.5,
                   layer_scale_init_value=0.7).train()
    errs = {}
    for core in ('fast', 'fused'):
        dp.ffn_core = core
        xi = x.clone().requires_grad_()
        torch.manual_seed(5)
        out = dp(xi)
        errs[core] = [out, *torch.autograd.grad(out, [xi, *dp.parameters()], grad)]
    res['drop path block fp32: fused against default'] = max(
        rel(a, b) for a, b in zip(errs['fused'], errs['fast']))
    assert all(fused[k].dtype == fast[k].dtype for k in fast)
    res['bf16 block: output, largest difference'] = (fused['out'] - fast['out']).abs().max().item()
    for part in ('x', 'ffn.', 'cpe1.', 'cpe2.'):
        res[f'bf16 block: gradients {part}'] = max(
            rel(fused[k], fast[k]) for k in fast if k == part or k.startswith(part))
    # whole NaLaFormers (the released layout, and NaLa in every stage) on the fused blocks and
    # the fused NaLa core, activation checkpointing
    for name, cfg in (('released', {}), ('NaLa everywhere',
                                         dict(attn_cfg=dict(type='NormAwareLinearAttention')))):
        torch.manual_seed(0)
        net = NaLaFormer(arch=dict(embed_dims=[16, 32, 32, 32], depths=[1, 1, 1, 1],
                                   num_heads=[1, 2, 2, 2], mlp_ratios=[2, 2, 2, 2]),
                         with_cp=True, drop_path_rate=0., norm_eval=True, **cfg).train()
        x = torch.randn(2, 3, 64, 96)
        # the float32 error of the same network in its default forms, the baseline
        res[f'train NaLaFormer {name}, with_cp, default forms (baseline)'] = train_vs_reference(
            copy.deepcopy(net), NormAwareLinearAttention, x, core='fast')
        assert set_fused_blocks(net, True) == 4
        res[f'train NaLaFormer {name}, with_cp, fused blocks'] = train_vs_reference(
            copy.deepcopy(net), NormAwareLinearAttention, x, core='fast')
        res[f'train NaLaFormer {name}, with_cp, fused blocks and core'] = train_vs_reference(
            copy.deepcopy(net), NormAwareLinearAttention, x, core='fused')
        set_fused_gates(net, True)  # every mixer's gated output (softmax ones included)
        res[f'train NaLaFormer {name}, with_cp, fused blocks, core and gates'] = \
            train_vs_reference(copy.deepcopy(net), NormAwareLinearAttention, x, core='fused')
        # the softmax mixers' RoPE (the float64 copy: torch's); the NaLa-everywhere layout has
        # no softmax mixer, and its run would be the one above again
        if set_fused_rope(net, True):
            res[f'train NaLaFormer {name}, with_cp, fused blocks, core, gates and RoPE'] = \
                train_vs_reference(net, NormAwareLinearAttention, x, core='fused')


def norm_gate_step(fn, s, proj, lw, lb, w, b, grad, needs=(True, ) * 6, autocast=False):
    """A training step of ``linear(layer_norm(s) * silu(g), w, b)`` through the Function ``fn``
    (None: plain autograd, the oracle), ``g`` the C channels ``[C:2C]`` of the (..., 4C)
    projection ``proj`` (rows 4C apart), the leaves those of ``needs`` (s, lw, lb, proj, w, b),
    under bf16 autocast on s's device with ``autocast``; returns the output and the leaves'
    gradients (None where not needed; proj's: the whole projection's)."""
    import torch.nn.functional as F
    leaves = [t.detach().clone().requires_grad_(n)
              for t, n in zip((s, lw, lb, proj, w, b), needs)]
    C = s.shape[-1]
    ins = leaves[:3] + [leaves[3][..., C:2 * C]] + leaves[4:]
    with torch.autocast(s.device.type, dtype=torch.bfloat16, enabled=autocast):
        if fn is None:
            y = F.linear(F.layer_norm(ins[0], (C, ), ins[1], ins[2], 1e-5) * F.silu(ins[3]),
                         ins[4], ins[5])
        else:
            y = fn.apply(ins[0], ins[1], ins[2], 1e-5, ins[3], ins[4], ins[5])
    y.backward(grad.to(y.dtype))
    return [y] + [t.grad if n else None for t, n in zip(leaves, needs)]


def run_norm_gate(res):
    """NaLa's gated output with its LayerNorm and gate fused (linattn_mm.ops.nala.gate_fused):
    the Function against plain autograd in float64; under bf16 autocast against the torch form
    and float64; the two NaLa mixers with gate_core='fused' against float64 on their reference
    cores."""
    from linattn_mm.models.attentions.nala import NaLaSoftmaxAttention
    from linattn_mm.ops.lean_layers import NormGatedLinear
    from linattn_mm.ops.nala.gate_fused import NormGatedLinearFused
    g0 = torch.Generator().manual_seed(11)

    names = ('output', 's', 'ln weight', 'ln bias', 'g (whole projection)', 'weight', 'bias')
    # tokens x channels: one tile, many tiles and chunks, C = 512, C not a power of two and an
    # output narrower than the input; the LayerNorm frozen and s without a gradient
    for B, N, C, Co, needs in ((2, 37, 24, 24, (True,) * 6), (1, 3000, 64, 64, (True,) * 6),
                               (2, 50, 512, 512, (True,) * 6),
                               (1, 10, 6, 5, (False, False, False, True, True, True))):
        s = torch.randn(B, N, C, generator=g0) * 3 + 1
        g = torch.randn(B, N, 4 * C, generator=g0) * 2  # the projection
        lw, lb = torch.randn(C, generator=g0), torch.randn(C, generator=g0)
        w, b = torch.randn(Co, C, generator=g0) / C ** 0.5, torch.randn(Co, generator=g0)
        grad = torch.randn(B, N, Co, generator=g0)
        got = norm_gate_step(NormGatedLinearFused, s, g, lw, lb, w, b, grad, needs)
        want = norm_gate_step(None, *(t.double() for t in (s, g, lw, lb, w, b, grad)), needs)
        assert all((a is None) == (c is None) for a, c in zip(got, want))
        res[f'gate fp32 C{C}'] = max(rel(a, c) for a, c in zip(got, want) if c is not None)
    # under bf16 autocast (g in bf16, as the projection gives it): the output against the torch
    # form's, each gradient's error against float64 with the torch form's beside it
    B, N, C = 2, 300, 64
    s = torch.randn(B, N, C, generator=g0) * 3 + 1
    g = (torch.randn(B, N, 4 * C, generator=g0) * 2).bfloat16()  # the projection, bf16
    lw, lb = torch.randn(C, generator=g0), torch.randn(C, generator=g0)
    w, b = torch.randn(C, C, generator=g0) / C ** 0.5, torch.randn(C, generator=g0)
    grad = torch.randn(B, N, C, generator=g0)
    fused = norm_gate_step(NormGatedLinearFused, s, g, lw, lb, w, b, grad, autocast=True)
    plain = norm_gate_step(NormGatedLinear, s, g, lw, lb, w, b, grad, autocast=True)
    want = norm_gate_step(None, *(t.double() for t in (s, g, lw, lb, w, b, grad)))
    assert [t.dtype for t in fused] == [t.dtype for t in plain]
    res['gate bf16: output against the torch form'] = rel(fused[0], plain[0])
    for name, a, p, c in zip(names, fused, plain, want):
        res[f'gate bf16 {name}: fused'] = rel(a, c)
        res[f'gate bf16 {name}: torch form'] = rel(p, c)
    # the mixers with their gated output fused (NaLa on its fused core too) in float32
    x = torch.randn(2, 12 * 10, 32, generator=g0)
    for cls, core in ((NormAwareLinearAttention, 'fused'), (NaLaSoftmaxAttention, 'fast')):
        torch.manual_seed(0)
        m = cls(32, 2).train()
        m.gate_core = 'fused'
        res[f'gate train {cls.__name__}'] = train_vs_reference(m, cls, x, (12, 10), core=core)



def run_rope(res):
    """The softmax stages' RoPE as one Triton kernel each way (linattn_mm.ops.nala.rope_fused):
    the Function against plain autograd of the reference rotation in float64 (float32 in and
    out; bfloat16 in and out, and against the torch form's two roundings); a NaLaSoftmaxAttention
    on core='fused' against a float64 copy on its reference core (float32), and under bf16
    autocast against the same mixer on core='fast'."""
    from linattn_mm.models.attentions.nala import NaLaSoftmaxAttention
    from linattn_mm.ops.nala import apply_rope, rotate_pairs
    from linattn_mm.ops.nala.rope_fused import RopeRotateFused, rope_table
    g0 = torch.Generator().manual_seed(13)
    # one block of tokens at d = 16; many blocks at d = 64
    for B, h, H, W, d in ((2, 3, 7, 9, 16), (1, 2, 30, 40, 64)):
        N = H * W
        sin, cos = RoPE2d(d)((H, W))
        proj = torch.randn(B, N, 4 * h * d, generator=g0)  # q: a head view of a projection
        for dt, name in ((torch.float32, 'fp32'), (torch.bfloat16, 'bf16')):
            full = proj.to(dt).requires_grad_()
            heads = full[..., :h * d].unflatten(-1, (h, d)).transpose(1, 2)
            grad = torch.randn(B, h, N, d, generator=g0).to(dt)
            y = RopeRotateFused.apply(heads, rope_table(sin, cos), dt)
            assert y.dtype == dt and y.shape == heads.shape
            assert y.transpose(1, 2).is_contiguous()  # a (B, N, h, d) buffer
            (dx, ) = torch.autograd.grad(y, full, grad)
            full64 = full.detach().double().requires_grad_()
            y64 = apply_rope(full64[..., :h * d].unflatten(-1, (h, d)).transpose(1, 2),
                             sin.double(), cos.double())
            (dx64, ) = torch.autograd.grad(y64, full64, grad.double())
            res[f'rope {name} d{d}: out'] = rel(y, y64)
            res[f'rope {name} d{d}: grad'] = rel(dx, dx64)
            if dt == torch.bfloat16:  # the torch form: float32 rotation, then autocast's cast
                torch_form = rotate_pairs(heads.detach().float(), sin, cos).to(dt).float()
                diff = (y.detach().float() - torch_form).abs()
                res[f'rope bf16 d{d}: share unlike the torch form'] = (
                    diff > 0).double().mean().item()
                res[f'rope bf16 d{d}: beyond one unit of the torch form'] = (
                    diff > torch_form.abs() * 2 ** -7).double().mean().item()
    # the mixer: float32 against float64 on the reference core
    x = torch.randn(2, 12 * 10, 32, generator=g0)
    torch.manual_seed(0)
    m = NaLaSoftmaxAttention(32, 2).train()
    res['rope train NaLaSoftmaxAttention'] = train_vs_reference(m, NaLaSoftmaxAttention, x,
                                                                (12, 10), core='fused')
    # under bf16 autocast: the output and the gradients of the input and every parameter
    # against the same mixer on core='fast' (q and k rounded once instead of twice)
    runs = []
    weights = torch.randn(2, 12 * 10, 32, generator=g0)
    for core in ('fast', 'fused'):
        m.core = core
        m.zero_grad(set_to_none=True)
        xi = x.detach().clone().requires_grad_()
        with torch.autocast('cpu', dtype=torch.bfloat16):
            out = m(xi, (12, 10))
        (out.float() * weights).sum().backward()
        runs.append([out.detach(), xi.grad] + [p.grad for p in m.parameters()])
    res['rope bf16 mixer against core fast'] = max(rel(a, b) for a, b in zip(*runs))

if __name__ == '__main__':
    results = {}
    which = sys.argv[1:] or ['pola', 'nala']
    if 'pola' in which:
        run_core(results)
        run_modules(results)
    if 'pola-grad' in which:
        run_core_grads(results)
        run_module_grads(results)
    if 'pola-fused' in which:
        run_core_grads(results, fused=True)
        run_module_grads(results, core='fused')
    if 'nala' in which:
        run_nala(results)
    if 'nala-grad' in which:
        run_nala_grads(results)
    if 'nala-fused' in which:
        run_nala_grads(results, fused=True)
    if 'conv-fused' in which:
        run_conv_sums(results)
    if 'gate-fused' in which:
        run_norm_gate(results)
    if 'rope-fused' in which:
        run_rope(results)
    json.dump(results, sys.stdout)
