"""The fused Pola core (:mod:`linattn_mm.ops.pola.fused`: the torch core's products, its
elementwise passes as three Triton kernels) against the float64 reference core. Without a GPU its
kernels run in Triton's interpreter on CPU tensors (a subprocess with ``TRITON_INTERPRET=1``,
``tests/kernels/triton_interpret_checks.py pola-fused``); on ``meta`` tensors its launches are one
operation each, with the bytes their kernels read and write."""
import pytest
import torch

import linattn_mm.ops.pola.fused as pf
from linattn_mm.cli import set_attention_core
from linattn_mm.models.attentions.nala import NormAwareLinearAttention
from linattn_mm.models.attentions.pola import PolaLinearAttention
from linattn_mm.ops.dispatch import fused_block, fused_chunks
from linattn_mm.ops.pola import polarity_attention
from linattn_mm.utils import TrafficCounter
from harness import triton_interpret_checks

pytestmark = pytest.mark.skipif(pf.triton is None, reason='Triton is not installed')

#: largest relative error (max |got - want| / max |want|) of a gradient: float32 arithmetic, or
#: the rounding of a gradient stored in half precision (Triton's interpreter truncates float32
#: to bfloat16, one unit in the last place)
TOL = 1e-5
HALF_TOL = {'bf16': 2 ** -7 + 1e-5, 'fp16': 2 ** -11 + 1e-5}


@pytest.fixture(scope='module')
def interpreted():
    return triton_interpret_checks('pola-fused')


def test_fused_core_and_its_gradients_equal_the_reference(interpreted):
    # six cases (float32 at d = 32, odd d = 7 with fewer keys than queries, d = 64 without
    # temperature, several chunks of keys, bf16 and fp16 inputs): the output and the gradient of
    # q, k, v, the position encoding, the exponents and the temperature against plain autograd
    # of the float64 reference on the same inputs
    core = {k: v for k, v in interpreted.items() if k.startswith('grad ')}
    assert len(core) == 40
    for name, err in core.items():
        tensor = name.rsplit(': ', 1)[1]
        half = next((t for t in HALF_TOL if f' {t} ' in name), None)
        tol = HALF_TOL[half] if half and tensor in ('q', 'k', 'v', 'pe') else TOL
        assert err < tol, f'{name}: relative error {err:.3g}'


def test_fused_core_writes_its_result_in_the_callers_dtype(interpreted):
    # out_dtype bf16 (fp16 for the fp16 case): the result is the float32 result rounded once, as
    # the division writes it, and a gradient given in that dtype is read as it is: the
    # gradients are those of the same values given in float32, bit for bit
    res = {k: v for k, v in interpreted.items() if k.startswith('outdtype ')}
    assert len(res) == 40
    assert all(err == 0 for err in res.values()), res


def test_training_steps_on_the_fused_core_equal_the_reference(interpreted):
    # Pola modules (both layouts, la_sr_ratio 2, a class token, the static gate, no gate and no
    # conv term) and a Pola-Swin backbone with activation checkpointing: the output, the input's
    # gradient and every parameter's gradient against a float64 copy on the reference cores
    steps = {k: v for k, v in interpreted.items() if k.startswith('train ')}
    assert len(steps) == 5
    for name, err in steps.items():
        assert err < TOL, f'{name}: relative error {err:.3g}'


def test_fused_core_on_meta_is_seven_launches_with_their_traffic():
    # a training step on meta tensors: the features of k and q (forward), of q again, the
    # output's gradient through the normalisation, then the features of k again and both
    # features' gradients (backward), each one operation that reads its inputs once and writes
    # its outputs once; the products are torch's
    B, h, N, d = 2, 3, 40, 12
    meta = dict(device='meta')
    q, k, v = (torch.empty(B, h, N, d, **meta, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    p, s = (torch.empty(1, h, 1, d, **meta, requires_grad=True) for _ in range(2))
    pe = torch.empty(1, h, N, d, **meta, requires_grad=True)
    with TrafficCounter() as tc:
        out = polarity_attention(q, k, v, p, 1e-6, s, pe, core='fused')
        out.backward(torch.empty_like(out))
    assert out.dtype == torch.bfloat16
    launches = [r[:2] for r in tc.records if r[0].startswith('pola_fused')]
    half, full, param = B * h * N * d * 2, B * h * N * d * 4, h * d * 4  # bytes
    pe_bytes = h * N * d * 4  # broadcast over the batch: addressed once
    features = 2 * full  # [x+ | x-], float32
    r = B * h * N * (d + 2) * 4  # [num | den], float32
    parts = B * h * fused_chunks(N, B * h, fused_block(d), torch.device('meta'))[0] * 16 * 4
    want = [('pola_fused_features', half + pe_bytes + 2 * param + features),  # k, pe -> [k+|k-]
            ('pola_fused_features', half + 2 * param + features),  # q -> [q+ | q-]
            ('pola_fused_features', half + 2 * param + features),  # backward: q again
            ('pola_fused_output_grad', r + half + r),  # r, the output's gradient (bf16) -> dr
            # q, [dq+ | dq-] -> dq (bf16), partial sums of d(1/s) and dp
            ('pola_fused_feature_grads', half + 2 * param + features + half + 2 * parts),
            ('pola_fused_features', half + pe_bytes + 2 * param + features),
            # k, pe, [dk+ | dk-] and the key sums' gradient (a (B, h, 2d) row added to every
            # token's) -> dk (float32: the bias's gradient is summed from it)
            ('pola_fused_feature_grads', half + pe_bytes + 2 * param + features
             + B * h * 2 * d * 4 + full + 2 * parts)]
    assert launches == want
    assert all(t.grad is not None and t.grad.shape == t.shape for t in (q, k, v, p, s, pe))


def test_a_pola_swin_t_step_moves_fewer_bytes_on_the_fused_core():
    # the whole training step of a small Pola-Swin backbone at 800 x 1344 / 4, bf16 autocast, on
    # meta: the same peak of live tensors, fewer operations and fewer bytes than the torch core
    from linattn_mm.models.backbones import LinAttnSwin
    from linattn_mm.utils import meta_autocast
    net = LinAttnSwin(arch=dict(embed_dims=32, depths=[1, 1, 1, 1], num_heads=[1, 2, 4, 8]),
                      attn_cfg=[dict(type='PolaLinearAttention', qkv_layout='qkvg')] * 2 + [
                          dict(type='WindowSoftmaxAttention', window_size=7)] * 2)
    net = net.to('meta').train()
    x = torch.empty(2, 3, 200, 336, device='meta')
    moved = {}
    for core in ('fast', 'fused'):
        for m in net.modules():
            if isinstance(m, PolaLinearAttention):
                m.core = core
        with TrafficCounter() as tc:
            with meta_autocast(torch.bfloat16):
                loss = sum(o.float().square().mean() for o in net(x))
            loss.backward()
        moved[core] = (len(tc.records), tc.bytes_moved)
        net.zero_grad(set_to_none=True)
    assert moved['fused'][0] < moved['fast'][0], moved
    assert moved['fused'][1] < 0.8 * moved['fast'][1], moved


def test_bad_inputs_and_devices_are_named(monkeypatch):
    monkeypatch.delenv('TRITON_INTERPRET', raising=False)
    q = torch.randn(1, 2, 8, 4, dtype=torch.float64)
    p = torch.ones(1, 2, 1, 4)
    with pytest.raises(TypeError, match='polarity_attention_fused: q has dtype torch.float64'):
        pf.polarity_attention_fused(q, q, q, p)
    q = q.float()
    with pytest.raises(RuntimeError, match='q is on cpu; the kernel runs on CUDA'):
        pf.polarity_attention_fused(q, q, q, p)
    with pytest.raises(ValueError, match=r'k and v must be \(B, h, n, d\)'):
        pf.polarity_attention_fused(q, torch.randn(1, 2, 8, 5), q, p)


def test_fused_core_options_are_named(monkeypatch):
    # the NaLa mixers' fused core runs the official kernel with the norm-aware power only (as
    # the Triton core); --attn-core fused needs CUDA (or the interpreter) and names a NaLa mixer
    # without one
    monkeypatch.delenv('TRITON_INTERPRET', raising=False)
    with pytest.raises(ValueError, match="kernel='paper' has no fused core"):
        NormAwareLinearAttention(32, 2, kernel='paper', core='fused')
    with pytest.raises(ValueError, match='a constant query_power has no fused core'):
        NormAwareLinearAttention(32, 2, query_power=2., core='fused')
    mixer = PolaLinearAttention(32, 2, pretrain_hw=(4, 4), core='fused')
    assert mixer.core == 'fused'
    with pytest.raises(ValueError, match='--attn-core fused: the model is on cpu'):
        set_attention_core(mixer, 'fused')
    monkeypatch.setenv('TRITON_INTERPRET', '1')  # Triton "available" on CPU: the NaLa check
    model = torch.nn.Sequential(PolaLinearAttention(32, 2, pretrain_hw=(4, 4)),
                                NormAwareLinearAttention(32, 2, kernel='paper'))
    with pytest.raises(ValueError, match=r"--attn-core fused: 1 \(kernel='paper', query_power="
                                         r"None\) has no fused core"):
        set_attention_core(model, 'fused')
    assert model[0].core == 'fast', 'nothing set when refused'
    model[1].kernel = 'official'
    assert set_attention_core(model, 'fused') == 2
    assert model[0].core == model[1].core == 'fused'
