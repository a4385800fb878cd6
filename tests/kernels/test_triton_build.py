"""The Triton kernels of the Pola and NaLa cores compiled for real GPUs without one: Hopper
(H100 / H200, 227 KB of shared memory per program), the A100 (163 KB) and the 99 KB of most other
recent cards, through Triton's compiler and ``ptxas`` (``tests/kernels/triton_build_checks.py``;
Ampere's kernels compiled once for ``sm_80`` and fitted to both Ampere limits, the code Triton
generates for ``sm_86`` being the same).

Triton's interpreter, which checks the kernels' values on CPU, neither compiles them nor knows a
GPU's limits: with version 0.6.10's launch (4 warps, blocks of 64 tokens) three pipeline stages of
the NaLa query gradients at head dim 64 with the RoPE (NaLaFormer-T's stages 1-2) needed about
280 KB and did not launch on an H200. :func:`linattn_mm.ops.dispatch.launch_fitted` fits the
stages to the device, and since 0.6.11 the kernels at head dim 64 launch with 8 warps and blocks
of 16 tokens (:func:`~linattn_mm.ops.dispatch.core_launch`), which need far less; since 0.6.12 the
gradient passes up to head dim 32 take 8 warps and blocks of 32. These tests hold every launch of a
forward and backward to the device's limit, and a kernel that cannot fit to an error that names
it; on Hopper also the bytes each kernel spills to local memory."""
import json
import os
import os.path as osp
import subprocess
import sys

import pytest

from linattn_mm.ops.dispatch import triton_module
from harness import REPO

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(triton_module() is None, reason='Triton is not installed')]

#: compute capability -> shared memory per program (bytes) of such GPUs
GPUS = {90: 227 * 1024, 80: 163 * 1024, 86: 99 * 1024}
KERNELS = {'pola': ['_pola_keys_kernel', '_pola_queries_kernel', '_pola_query_grad_kernel',
                    '_pola_key_grad_kernel'],
           'nala': ['_nala_keys_kernel', '_nala_queries_kernel', '_nala_query_grad_kernel',
                    '_nala_key_grad_kernel']}


@pytest.fixture(scope='module')
def builds(tmp_path_factory):
    """arch -> the script's launches: Hopper's, and Ampere's compiled once for ``sm_80`` and
    fitted to the A100's limit and to the ``sm_86`` cards' (the same code; see the script), the
    two compiled side by side."""
    env = dict(os.environ, PYTHONWARNINGS='ignore',
               TRITON_CACHE_DIR=str(tmp_path_factory.mktemp('triton_cache')),
               PYTHONPATH=os.pathsep.join(p for p in (osp.join(REPO, 'tests'),
                                                      os.environ.get('PYTHONPATH')) if p))
    env.pop('TRITON_INTERPRET', None)
    script = osp.join(REPO, 'tests', 'kernels', 'triton_build_checks.py')
    # Hopper's kernels also assembled by ptxas -v: the bytes they spill to local memory
    runs = {(90, ): [str(GPUS[90]), 'spills'], (80, 86): [f'{GPUS[80]},{GPUS[86]}']}
    procs = {archs: subprocess.Popen([sys.executable, script, str(archs[0])] + args, env=env,
                                     cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True) for archs, args in runs.items()}
    out = {}
    try:
        for archs, proc in procs.items():
            stdout, stderr = proc.communicate(timeout=900)
            assert proc.returncode == 0, stderr[-3000:]
            lines = stdout.splitlines()
            if len(lines) == 1 and isinstance(json.loads(lines[0]), dict):
                lines = lines * len(archs)  # {"unsupported": ...}
            assert len(lines) == len(archs), stdout[-3000:]
            out.update((arch, json.loads(line)) for arch, line in zip(archs, lines))
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    if any(isinstance(r, dict) for r in out.values()):
        pytest.skip(next(r for r in out.values() if isinstance(r, dict))['unsupported'])
    return out


@pytest.fixture(scope='module')
def core_builds(builds):
    """arch -> the launches of the Pola and NaLa Triton cores (the fused core's cases apart)."""
    return {arch: [r for r in results if not r[0].startswith('fused ')]
            for arch, results in builds.items()}


def _cases(results):
    cases = {}
    for case, *launch in results:
        cases.setdefault(case, []).append(launch)
    return cases


#: arch -> the cases that do not fit: the products on the tensor cores (tf32x3) take larger
#: tiles, and their gradient passes at d = 64 need more than some GPUs have
MAY_NOT_FIT = {90: {'nala d64 fp32 rope tf32x3'},
               80: {'nala d64 fp32 rope tf32x3'},
               86: {'pola d64 fp32 pe+temperature tf32x3', 'nala d64 fp32 rope tf32x3'}}


def _error_need(message, kernels, limit):
    """The bytes an error of launch_fitted says a kernel needs, checked to name one of
    ``kernels``, the limit and the way out."""
    name, rest = message.split(': needs ', 1)
    assert name in kernels, message
    assert f'allows {limit}; ' in rest and "core='fast'" in rest, message
    need = int(rest.split()[0])
    assert need > limit, message
    return need


@pytest.mark.parametrize('arch', sorted(GPUS))
def test_every_launch_fits_the_shared_memory(core_builds, arch):
    cases = _cases(core_builds[arch])
    assert len(cases) == 14
    failed = set()
    for case, launches in cases.items():
        family = case.split()[0]
        errors = [launch[1] for launch in launches if launch[0] == 'error']
        launched = [launch for launch in launches if launch[0] != 'error']
        for name, stages, shared, _, seconds in launched:
            assert isinstance(seconds, float) and seconds >= 0, (case, name, seconds)
            assert 1 <= stages <= 3, (case, name, stages)
            assert 0 < shared <= GPUS[arch], (case, name, shared)
        if errors:  # a gradient pass that cannot fit: named, after the kernels before it ran
            failed.add(case)
            _error_need(errors[0], KERNELS[family][2:], GPUS[arch])
            assert 'tf32x3' in errors[0]  # the hint names the precision asked for
            assert [name for name, *_ in launched] == \
                KERNELS[family][:len(launched)], (case, launches)
        else:  # forward and backward: the four kernels, each launched once
            assert [name for name, *_ in launched] == KERNELS[family], (case, launches)
    assert failed == MAY_NOT_FIT[arch]


def test_hopper_and_the_a100_keep_every_stage(core_builds):
    # with float32 products every kernel keeps its three pipeline stages on Hopper and on the
    # A100 (with 0.6.10's launch the NaLa query and key gradients at d = 64 with the RoPE lost
    # one or two of them there)
    for arch in (90, 80):
        launches = {(case, name): stages for case, name, stages, *_ in core_builds[arch]
                    if not case.endswith('tf32x3')}
        assert len(launches) == 48 and set(launches.values()) == {3}, (arch, launches)


def test_the_stages_docs_benchmarks_gives(core_builds):
    # docs/benchmarks.md, "On a GPU: NVIDIA H200 (version 0.6.11)": on 99 KB cards the NaLa
    # gradient passes at d = 64 with the RoPE run with one and two stages (in 0.6.10 the query
    # gradients did not fit there at all), its query gradients with bf16 inputs at d = 64 with
    # two, every other kernel with float32 products with three (since 0.6.12 the NaLa query
    # gradients at d = 32 too: with float32 inputs and 0.6.11's launch they needed 123392 bytes
    # with three stages, which left them two)
    stages = {(case, name): launch[0] for case, name, *launch in core_builds[86]
              if name != 'error' and not case.endswith('tf32x3')}
    assert stages.pop(('nala d64 bf16 rope', '_nala_query_grad_kernel')) == 2
    assert stages.pop(('nala d64 fp32 rope', '_nala_query_grad_kernel')) == 1
    assert stages.pop(('nala d64 fp32 rope', '_nala_key_grad_kernel')) == 2
    assert set(stages.values()) == {3}, stages


def test_a_kernel_that_cannot_fit_is_named(core_builds):
    # on a 99 KB card the Pola query gradients at d = 64 with the products on the tensor cores
    # need more than that even with one stage: the error names the kernel, its need, the limit
    # and the precision asked for, before any launch of it
    launches = _cases(core_builds[86])['pola d64 fp32 pe+temperature tf32x3']
    errors = [launch for launch in launches if launch[0] == 'error']
    assert len(errors) == 1
    _error_need(errors[0][1], ['_pola_query_grad_kernel'], GPUS[86])
    assert "precision of the products ('ieee', not 'tf32x3')" in errors[0][1]
    # the forward ran (its two kernels fitted), the backward stopped at the query gradients
    assert [launch[0] for launch in launches if launch[0] != 'error'] == KERNELS['pola'][:2]


def _hopper_spills(core_builds):
    """(case, kernel) -> bytes of spill stores on Hopper, for every launch with float32 products
    (the tf32x3 cases left out); skips where this Triton's ptxas was not found."""
    spills = {(case, name): launch[2] for case, name, *launch in core_builds[90]
              if name != 'error' and not case.endswith('tf32x3')}
    if any(v is None for v in spills.values()):
        pytest.skip("this Triton's ptxas was not found")
    return spills


def test_head_dim_64_kernels_keep_their_accumulators_in_registers(core_builds):
    # ptxas -v on Hopper, float32 products: with 0.6.10's launch (4 warps, blocks of 64 tokens)
    # each kernel at d = 64 spilled about 2 to 50 KB per thread to local memory (bf16 inputs with
    # the position encoding and temperature, or the RoPE); with core_launch's 8 warps and blocks
    # of 16 none spills more than 2 KB, those with bf16 and the extras at most 1 KB (84 and 556
    # bytes in docs/benchmarks.md), and the forward kernels (the inference path) at every head
    # dim at most 512 bytes
    spills = _hopper_spills(core_builds)
    assert len(spills) == 48, spills
    d64 = {k: v for k, v in spills.items() if ' d64 ' in k[0]}
    assert len(d64) == 24 and max(d64.values()) <= 2048, d64
    documented = {k: v for k, v in d64.items()
                  if k[0] in ('pola d64 bf16 pe+temperature', 'nala d64 bf16 rope')}
    assert len(documented) == 8 and max(documented.values()) <= 1024, documented
    forward = {k: v for k, v in spills.items() if k[1].endswith(('_keys_kernel',
                                                                   '_queries_kernel'))}
    assert len(forward) == 24 and max(forward.values()) <= 512, forward


def test_gradient_passes_up_to_head_dim_32_spill_nothing(core_builds):
    # ptxas -v on Hopper, float32 products: with 0.6.11's launch at d <= 32 (4 warps, blocks of 64
    # tokens) the Pola query gradients spilled 1948 bytes per thread with bf16 inputs and 10228
    # with float32 inputs, the NaLa query and key gradients up to 1928 and 10752; with
    # core_launch's 8 warps and blocks of 32 for the gradient passes, none spills (bf16 and
    # float32 inputs, d = 12 and 32, with the position encoding and temperature or the RoPE)
    spills = {k: v for k, v in _hopper_spills(core_builds).items()
              if ' d64 ' not in k[0] and k[1].endswith(('_query_grad_kernel', '_key_grad_kernel'))}
    assert len(spills) == 12 and set(spills.values()) == {0}, spills


def _assert_small(cases, arch, launches_of, shared_limit=4096):
    """Each case (name -> its launches) launches the kernels ``launches_of(case)`` names, in
    that order, each with three pipeline stages, at most ``shared_limit`` bytes of shared memory
    and, on Hopper, no spills (elsewhere not assembled: None)."""
    for case, launches in cases.items():
        assert [launch[0] for launch in launches] == launches_of(case), (case, launches)
        for name, stages, shared, spills, _ in launches:
            assert stages == 3 and shared <= shared_limit, (case, name, stages, shared)
            assert spills in (None, 0) if arch == 90 else spills is None, (case, name, spills)


#: the fused cores' launches, forward and backward: Pola's key and query features, then the
#: query features again, the output's gradient through the normalisation, the query features'
#: gradients, the key features, their gradients; NaLa's the same without the output's gradient
FUSED_LAUNCHES = {
    'pola': ['_pola_features_kernel'] * 3 + ['_pola_output_grad_kernel',
                                             '_pola_feature_grads_kernel',
                                             '_pola_features_kernel',
                                             '_pola_feature_grads_kernel'],
    'nala': ['_nala_fused_features_kernel'] * 3 + ['_nala_fused_query_grads_kernel',
                                                   '_nala_fused_features_kernel',
                                                   '_nala_fused_key_grads_kernel']}


@pytest.mark.parametrize('arch', sorted(GPUS))
def test_the_fused_cores_elementwise_kernels_are_small(builds, arch):
    # the fused cores' kernels hold a tile of the map and no (d x d) state: every launch keeps
    # its three pipeline stages with at most 4 KB of shared memory on every GPU, and on Hopper
    # none spills (d = 12 float32, d = 32 and 64 bf16; Pola with the position encoding and
    # temperature, NaLa with the RoPE and at d = 32 without)
    cases = {case: launches for case, launches in _cases(builds[arch]).items()
             if case.startswith(('fused pola ', 'fused nala '))}
    assert set(cases) == {f'fused {family} d{d} {dtype} {extras}'
                          for family, extras in (('pola', 'pe+temperature'), ('nala', 'rope'))
                          for d, dtype in ((12, 'fp32'), (32, 'bf16'), (64, 'bf16'))} | {
                              'fused nala d32 bf16'}
    _assert_small(cases, arch, lambda case: FUSED_LAUNCHES[case.split()[1]])


#: a block's conv sums, forward and backward: the ConvFFN's sum, then in its backward the sum
#: again and the flipped sum times gelu'; the CPE's sum (with its half-precision copy under
#: autocast) and the flipped sum
CONV_SUM_LAUNCHES = {'convffn': ['_conv_sum_kernel'] * 3, 'cpe': ['_conv_sum_kernel'] * 2,
                     'residual': ['_scaled_add_grads_kernel']}


@pytest.mark.parametrize('arch', sorted(GPUS))
def test_the_fused_gate_is_small(builds, arch):
    # NaLa's gated output (ops.nala.gate_fused), forward and backward: a tile of 1024 elements
    # in float64 (2 tokens at C = 512); three pipeline stages with at most 8 KB of shared memory
    # (the float64 row sums) on every GPU, no spills on Hopper
    cases = {case: launches for case, launches in _cases(builds[arch]).items()
             if case.startswith('fused gate ')}
    assert set(cases) == {'fused gate c64 fp32', 'fused gate c512 bf16'}
    _assert_small(cases, arch, lambda case: ['_norm_gate_kernel', '_norm_gate_grads_kernel'],
                  shared_limit=8192)


@pytest.mark.parametrize('arch', sorted(GPUS))
def test_the_fused_rope_is_small(builds, arch):
    # the softmax stages' RoPE (ops.nala.rope_fused), forward and backward: a tile of tokens by
    # channel pairs; three pipeline stages with at most 4 KB of shared memory on every GPU, no
    # spills on Hopper
    cases = {case: launches for case, launches in _cases(builds[arch]).items()
             if case.startswith('fused rope ')}
    assert set(cases) == {'fused rope d64 bf16', 'fused rope d16 fp32'}
    _assert_small(cases, arch, lambda case: ['_rope_kernel'] * 2)


@pytest.mark.parametrize('arch', sorted(GPUS))
def test_the_fused_conv_sums_are_small(builds, arch):
    # NaLaFormer blocks' conv sums and residual sums' backward (ops.ffn.fused) hold one tile of
    # the map: three pipeline stages with at most 4 KB of shared memory on every GPU, and on
    # Hopper no spills (float32 at width 64; the conv in bf16 at width 256, channels-last and
    # NCHW; the residual's branch channels-last)
    cases = {case: launches for case, launches in _cases(builds[arch]).items()
             if case.startswith(('fused convffn ', 'fused cpe ', 'fused residual '))}
    assert set(cases) == {f'fused {kind} {width}' for kind in ('convffn', 'cpe', 'residual')
                          for width in ('c64 fp32', 'c256 bf16')}
    _assert_small(cases, arch, lambda case: CONV_SUM_LAUNCHES[case.split()[1]])
