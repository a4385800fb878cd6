"""Compile the Triton kernels of the Pola and NaLa cores for a CUDA architecture, without a GPU.

Run as a script (by ``tests/kernels/test_triton_build.py``, in a subprocess): ``ARCH LIMIT
[spills]``, a compute capability (90, 80), the shared memory per program of such a GPU in bytes
and, with ``spills``, the bytes each kernel spills to local memory as ``ptxas -v`` reports them
(the kernel's PTX assembled again for that GPU by the ``ptxas`` Triton ships). ``LIMIT`` may be
several limits, comma-separated: the cases run once per limit, in that order, the stage fitting
started afresh each time and the kernels already compiled taken from Triton's cache (their
compile seconds then about 0); one JSON list is printed per limit, a line each. The tests compile
Ampere's kernels once, for ``sm_80``, and fit them to the A100's 163 KB and to the 99 KB of the
``sm_86`` cards: Triton generates the same code for both (compiled for each, version 0.6.20's
kernels took the same shared memory at the same stages in every launch). Triton's
active driver is replaced by one that names that GPU as its target and launches nothing, so every
kernel goes through Triton's real compiler and ``ptxas`` for it; :func:`launch_fitted` fits the
pipeline stages to ``LIMIT`` as on that GPU. Each core runs forward and backward on CPU tensors of
several head dims, dtypes and options, two of them with the products on the tensor cores
(``tf32x3``; nothing is computed: the outputs are empty buffers), and so do the fused cores
(cases ``fused ...``: their elementwise kernels), and the conv sums of NaLaFormer's blocks
(cases ``fused convffn ...``, ``fused cpe ...``, ``fused residual ...``), NaLa's fused
gated output (``fused gate ...``) and the softmax stages' fused RoPE (``fused rope ...``). Prints
a JSON list, one entry per kernel launched: ``[case, kernel, stages, shared bytes, spill stores
in bytes or None, compile seconds]``, or ``[case, 'error', message]`` for a case that raised. The
seconds are those of Triton's compiler and ``ptxas`` for that launch, the stage fitting's
compilations included (the first of a kernel and specialization; with ``TRITON_CACHE_DIR`` an
empty folder, the first launch of each): what a GPU machine's CPU spends before the kernel's
first launch, on this CPU.
"""
import functools
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import torch

try:
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction
except ImportError as e:  # pragma: no cover - depends on the Triton version
    print(json.dumps({'unsupported': f'this Triton has no {e.name}'}))
    sys.exit(0)

ARCH, LIMITS = int(sys.argv[1]), [int(v) for v in sys.argv[2].split(',')]
SPILLS = sys.argv[3:] == ['spills']


class CompileOnlyDriver:
    """Triton's driver for a GPU of compute capability ARCH that is not there."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget('cuda', ARCH, 32)  # NVIDIA's warp: 32 threads

    def get_active_torch_device(self):
        return torch.device('cpu')


LAUNCHED = []
_run = JITFunction.run
_COMPILING = [0.0]  # seconds of compilation since the last recorded launch


@functools.lru_cache(maxsize=None)
def _ptxas():
    """The ``ptxas`` Triton compiles with (``TRITON_PTXAS_PATH`` or the one it ships), or None."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas
        return get_ptxas(ARCH).path
    except Exception:  # pragma: no cover - depends on the Triton version
        import triton
        path = os.path.join(os.path.dirname(triton.__file__), 'backends', 'nvidia', 'bin',
                            'ptxas')
        return path if os.path.isfile(path) else None


def spill_stores(ptx):
    """The bytes of spill stores ``ptxas -v`` reports for the kernel of ``ptx`` on ARCH (None
    without a ``ptxas``)."""
    ptxas = _ptxas()
    if ptxas is None:  # pragma: no cover - depends on the Triton installation
        return None
    arch = f'sm_{ARCH}' + ('a' if ARCH == 90 else '')
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, 'kernel.ptx')
        with open(src, 'w') as f:
            f.write(ptx)
        res = subprocess.run([ptxas, f'-arch={arch}', '-v', src, '-o', os.path.join(tmp, 'k.o')],
                             capture_output=True, text=True, check=True)
    return int(re.search(r'(\d+) bytes spill stores', res.stderr).group(1))


def _compile_only(self, *args, grid, warmup, **kwargs):
    """Compile as the launch would; record a launch (not the stage fitting's compilations, whose
    time counts for the launch that follows them)."""
    start = time.perf_counter()
    kernel = _run(self, *args, grid=grid, warmup=True, **kwargs)
    _COMPILING[0] += time.perf_counter() - start
    if not warmup:
        spills = spill_stores(kernel.asm['ptx']) if SPILLS else None
        LAUNCHED.append((self.fn.__name__, kwargs.get('num_stages'), kernel.metadata.shared,
                         spills, round(_COMPILING[0], 2)))
        _COMPILING[0] = 0.0
    return kernel


def main():
    try:
        driver.set_active(CompileOnlyDriver())
    except (AttributeError, TypeError) as e:  # pragma: no cover - depends on the Triton version
        print(json.dumps({'unsupported': f"this Triton's driver cannot be replaced ({e})"}))
        return
    JITFunction.run = _compile_only
    import linattn_mm.ops.dispatch as dispatch
    dispatch._interpreting = lambda: True  # the cores' device checks accept CPU tensors
    from linattn_mm.ops.nala.triton import nala_attention_triton
    from linattn_mm.models.backbones.nalaformer import ConvFFN
    from linattn_mm.ops.ffn.fused import ConvResidualFused, ScaledAddFused, conv_ffn_branch_fused
    from linattn_mm.ops.nala.fused import nala_attention_fused
    from linattn_mm.ops.nala.gate_fused import NormGatedLinearFused
    from linattn_mm.ops.nala.rope_fused import RopeRotateFused
    from linattn_mm.ops.pola.fused import polarity_attention_fused
    from linattn_mm.ops.pola.triton import polarity_attention_triton

    def qkv(d, dtype, B=2, h=2, N=77):
        return [torch.randn(B, h, N, d, dtype=dtype, requires_grad=True) for _ in range(3)]

    def pola(d, dtype, extras, core=polarity_attention_triton):
        q, k, v = qkv(d, dtype)
        kw = dict(temperature=torch.ones(1, 2, 1, 1, requires_grad=True)) if extras else {}
        if extras:
            kw['k_bias'] = torch.randn(1, 2, 77, d, requires_grad=True)
        p = torch.full((1, 2, 1, d), 3.0, requires_grad=True)
        return core(q, k, v, p, **kw)

    def fused(d, dtype, extras):
        return pola(d, dtype, extras, polarity_attention_fused)

    def nala(d, dtype, rope, core=nala_attention_triton):
        q, k, v = qkv(d, dtype)
        kw = {}
        if rope:
            angle = torch.randn(77, d // 2).repeat_interleave(2, -1)
            kw = dict(sin=angle.sin(), cos=angle.cos())
        return core(q, k, v, **kw)

    def fused_nala(d, dtype, rope):
        return nala(d, dtype, rope, nala_attention_fused)

    def conv_ffn(width, dtype, _):
        ffn = ConvFFN(width // 4, width).to(dtype)
        norm = torch.nn.LayerNorm(width // 4).to(dtype)
        x = torch.randn(2, 9, 13, width // 4, dtype=dtype, requires_grad=True)
        return conv_ffn_branch_fused(x, norm, ffn)

    def cpe(width, dtype, _):
        conv = torch.nn.Conv2d(width, width, 3, 1, 1, groups=width)
        x = torch.randn(2, width, 9, 13, requires_grad=True)
        return ConvResidualFused.apply(x, conv.weight, conv.bias, dtype)

    def residual(width, dtype, _):  # a block's residual sum with its layer scale (backward)
        x = torch.randn(2, width, 9, 13, requires_grad=True)
        b = torch.randn(2, 9, 13, width, dtype=dtype).permute(0, 3, 1, 2).requires_grad_()
        return ScaledAddFused.apply(x, b, torch.ones(1, width, 1, 1, requires_grad=True), None)

    def gate(width, dtype, _):  # NaLa's gated output: s float32, g as the projection gives it
        s = torch.randn(2, 77, width, requires_grad=True)
        g = torch.randn(2, 77, width, dtype=dtype, requires_grad=True)
        norm, lin = torch.nn.LayerNorm(width), torch.nn.Linear(width, width)
        with torch.autocast('cpu', dtype=torch.bfloat16, enabled=dtype != torch.float32):
            return NormGatedLinearFused.apply(s, norm.weight, norm.bias, 1e-5, g, lin.weight,
                                              lin.bias)

    def rope(d, dtype, _):  # q as a head view of the projection, written in the autocast dtype
        x = torch.randn(2, 77, 4 * 2 * d, dtype=dtype)[..., :2 * d].unflatten(-1, (2, d))
        x = x.transpose(1, 2).requires_grad_()
        angle = torch.randn(77, d // 2)
        table = torch.stack([angle.cos(), angle.sin()], -1)
        return RopeRotateFused.apply(x, table, torch.bfloat16)

    cases = {}
    for d in (12, 32, 64):
        cases[f'pola d{d} fp32 pe+temperature'] = (pola, d, torch.float32, True)
        cases[f'nala d{d} fp32 rope'] = (nala, d, torch.float32, True)
    cases['pola d64 bf16'] = (pola, 64, torch.bfloat16, False)
    cases['nala d64 fp16'] = (nala, 64, torch.float16, False)
    # the half-precision inputs of training under autocast, with the layers' extras
    for d in (32, 64):
        cases[f'pola d{d} bf16 pe+temperature'] = (pola, d, torch.bfloat16, True)
        cases[f'nala d{d} bf16 rope'] = (nala, d, torch.bfloat16, True)
    # the products on the tensor cores (dispatch.triton_dot_precision)
    cases['pola d64 fp32 pe+temperature tf32x3'] = (pola, 64, torch.float32, True)
    cases['nala d64 fp32 rope tf32x3'] = (nala, 64, torch.float32, True)
    # the fused cores' elementwise kernels (their products are torch's)
    for d, dtype in ((12, torch.float32), (32, torch.bfloat16), (64, torch.bfloat16)):
        name = 'fp32' if dtype == torch.float32 else 'bf16'
        cases[f'fused pola d{d} {name} pe+temperature'] = (fused, d, dtype, True)
        cases[f'fused nala d{d} {name} rope'] = (fused_nala, d, dtype, True)
    cases['fused nala d32 bf16'] = (fused_nala, 32, torch.bfloat16, False)
    # NaLaFormer blocks' conv sums (ops.ffn.fused): a ConvFFN on a channels-last map (d: its
    # width), a CPE on an NCHW map, float32 or with the conv in bf16 as under autocast
    for width, dtype in ((64, torch.float32), (256, torch.bfloat16)):
        name = 'fp32' if dtype == torch.float32 else 'bf16'
        cases[f'fused convffn c{width} {name}'] = (conv_ffn, width, dtype, None)
        cases[f'fused cpe c{width} {name}'] = (cpe, width, dtype, None)
        cases[f'fused residual c{width} {name}'] = (residual, width, dtype, None)
    # NaLa's gated output (ops.nala.gate_fused): stage 1's width in float32, stage 4's in bf16
    for width, dtype in ((64, torch.float32), (512, torch.bfloat16)):
        cases[f'fused gate c{width} {"fp32" if dtype == torch.float32 else "bf16"}'] = (
            gate, width, dtype, None)
    # the softmax stages' RoPE (ops.nala.rope_fused): NaLaFormer-T's head dim in bf16 (the
    # projection under autocast), a small one in float32
    cases['fused rope d64 bf16'] = (rope, 64, torch.bfloat16, None)
    cases['fused rope d16 fp32'] = (rope, 16, torch.float32, None)
    for limit in LIMITS:
        dispatch._stage_limit = lambda device: limit
        dispatch._FITTED_STAGES.clear()  # each launch fitted to this limit
        results = []
        for case, (fn, d, dtype, flag) in cases.items():
            del LAUNCHED[:]
            _COMPILING[0] = 0.0  # not the compilations of a case that raised before its launch
            try:
                with dispatch.triton_dot_precision('tf32x3' if case.endswith('tf32x3') else
                                                   'ieee'):
                    fn(d, dtype, flag).float().sum().backward()
            except RuntimeError as e:
                results.append([case, 'error', str(e)])
            results += [[case, *launch] for launch in LAUNCHED]
        print(json.dumps(results), flush=True)


if __name__ == '__main__':
    main()
