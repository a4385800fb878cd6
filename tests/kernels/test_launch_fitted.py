"""launch_fitted's choice of pipeline stages, with a stand-in kernel whose compiled shared memory
is known (the Triton kernels themselves: tests/kernels/test_triton_build.py)."""
from types import SimpleNamespace

import pytest
import torch

from linattn_mm.ops import dispatch


class StandInKernel:
    """``kernel[grid](*args, **kw)`` and ``kernel.warmup(...)`` as a Triton JIT function has them;
    shared memory = ``per_stage`` bytes per pipeline stage."""

    def __init__(self, per_stage):
        self.per_stage, self.compiled, self.launched = per_stage, [], []
        self.fn = SimpleNamespace(__name__='_stand_in_kernel')

    def warmup(self, *args, grid, num_stages, **kwargs):
        self.compiled.append(num_stages)
        return SimpleNamespace(metadata=SimpleNamespace(shared=self.per_stage * num_stages))

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launched.append((grid, args, kwargs))
        return launch


@pytest.fixture
def device_with(monkeypatch):
    """Make launch_fitted see a GPU with the given shared memory per program."""
    monkeypatch.setattr(dispatch, '_FITTED_STAGES', {})

    def set_limit(limit):
        monkeypatch.setattr(dispatch, '_stage_limit', lambda device: limit)
    return set_limit


def test_the_most_stages_that_fit_chosen_once(device_with):
    device_with(100_000)
    kernel = StandInKernel(40_000)  # 3 stages: 120 000 B, 2: 80 000 B
    x = torch.zeros(4)
    dispatch.launch_fitted(kernel, (2, 3), x, 7, D=32, num_warps=4)
    dispatch.launch_fitted(kernel, (2, 3), x, 9, D=32, num_warps=4)
    assert kernel.compiled == [3, 2]  # compiled to choose, once for these options and dtypes
    assert [launch[2] for launch in kernel.launched] == [dict(D=32, num_warps=4, num_stages=2)] * 2
    assert kernel.launched[1][:2] == ((2, 3), (x, 9))
    # other constexprs or dtypes are another kernel: chosen again
    dispatch.launch_fitted(kernel, (2, 3), x.double(), 7, D=32, num_warps=4)
    dispatch.launch_fitted(kernel, (2, 3), x, 7, D=64, num_warps=4)
    assert kernel.compiled == [3, 2, 3, 2, 3, 2]


def test_a_fitting_kernel_keeps_its_stages(device_with):
    device_with(227 * 1024)
    kernel = StandInKernel(40_000)
    dispatch.launch_fitted(kernel, (1,), torch.zeros(1), num_stages=4)
    assert kernel.compiled == [4] and kernel.launched[0][2] == dict(num_stages=4)


def test_a_kernel_too_large_for_one_stage_is_named(device_with):
    device_with(99 * 1024)
    kernel = StandInKernel(150_000)
    with pytest.raises(RuntimeError, match=r"_stand_in_kernel: needs 150000 bytes of shared memory "
                                           r"per program with one pipeline stage, and cpu allows "
                                           r"101376; use the torch core \(core='fast'\)") as e:
        dispatch.launch_fitted(kernel, (1,), torch.zeros(1))
    assert kernel.compiled == [3, 2, 1] and kernel.launched == []
    assert 'precision' not in str(e.value)  # float32 products: no hint about them


def test_off_cuda_and_interpreted_launches_as_asked(monkeypatch):
    # off CUDA nothing is fitted (CPU tensors reach a launch only under the interpreter); under
    # the interpreter the kernel runs with the stages asked, nothing compiled
    assert dispatch._stage_limit(torch.device('cpu')) is None
    assert dispatch._stage_limit(torch.device('meta')) is None
    monkeypatch.setattr(dispatch, '_interpreting', lambda: True)
    kernel = StandInKernel(10 ** 9)
    dispatch.launch_fitted(kernel, (1,), torch.zeros(1), num_stages=2, D=16)
    assert kernel.compiled == [] and kernel.launched[0][2] == dict(num_stages=2, D=16)


def test_a_specialization_of_its_own_is_fitted_again(device_with):
    # Triton compiles a kernel per alignment of the pointers and divisibility of the integers,
    # whose shared memory differs: each is fitted when it first comes
    device_with(100_000)
    kernel = StandInKernel(40_000)
    x = torch.zeros(64)
    dispatch.launch_fitted(kernel, (1,), x, 32, D=32)
    dispatch.launch_fitted(kernel, (1,), x[1:], 32, D=32)  # 4 bytes off: another kernel
    dispatch.launch_fitted(kernel, (1,), x[4:], 48, D=32)  # 16 bytes off, 48 = 3 * 16: the first
    dispatch.launch_fitted(kernel, (1,), x, 33, D=32)  # not a multiple of 16: another
    dispatch.launch_fitted(kernel, (1,), x, 1, D=32)  # 1: another
    assert kernel.compiled == [3, 2] * 4
    assert dispatch._specialization((x, 32, 1e-6)) == ((torch.float32, True), (True, False), float)


def test_dot_precision_of_a_block():
    # the Triton cores' products: 'ieee' unless a block asks for another, restored after it (also
    # when it raises); an unknown precision is refused with the valid ones
    assert dispatch.dot_precision() == 'ieee'
    with dispatch.triton_dot_precision('tf32x3'):
        assert dispatch.dot_precision() == 'tf32x3'
        with dispatch.triton_dot_precision('tf32'):
            assert dispatch.dot_precision() == 'tf32'
        assert dispatch.dot_precision() == 'tf32x3'
    with pytest.raises(KeyError):
        with dispatch.triton_dot_precision('tf32'):
            raise KeyError('inside')
    assert dispatch.dot_precision() == 'ieee'
    with pytest.raises(ValueError, match=r"precision must be one of \('ieee', 'tf32x3', 'tf32'\), "
                                         r"got 'bf16'"):
        with dispatch.triton_dot_precision('bf16'):
            pass


def test_a_kernel_too_large_with_tensor_core_products_names_the_precision(device_with):
    device_with(99 * 1024)
    kernel = StandInKernel(150_000)
    with pytest.raises(RuntimeError, match=r"core='fast'\) on this GPU or the default precision "
                                           r"of the products \('ieee', not 'tf32x3'\)"):
        dispatch.launch_fitted(kernel, (1,), torch.zeros(1), PREC='tf32x3')


def test_core_launch_by_phase_and_head_dim():
    # up to a padded head dim of 32 the forward kernels keep the launch measured on the H200 and
    # the gradient passes take 8 warps and blocks of 32 (no spills when assembled for sm_90:
    # tests/kernels/test_triton_build.py); above, both phases take 8 warps and blocks of 16
    for d in (1, 12, 16, 31, 32):
        assert dispatch.core_launch(d) == dispatch.core_launch(d, 'forward') == (4, 64)
        assert dispatch.core_launch(d, 'backward') == (8, 32)
    for d in (33, 48, 64, 128):
        assert dispatch.core_launch(d, 'forward') == dispatch.core_launch(d, 'backward') == (8, 16)
    assert dispatch.core_blocks(32, 'forward') == (64, 64)
    assert dispatch.core_blocks(32, 'backward') == (32, 32)
    assert dispatch.core_blocks(32, 'backward', 16) == (16, 32)
    assert dispatch.core_blocks(64, 'forward', None, 128) == (16, 128)
    with pytest.raises(ValueError, match=r"phase must be one of \('forward', 'backward'\), got "
                                         r"'bwd'"):
        dispatch.core_launch(32, 'bwd')


def test_a_block_sets_the_launch_of_a_phase():
    with dispatch.triton_core_launch(backward=(4, 64)):
        assert dispatch.core_launch(32, 'backward') == dispatch.core_launch(64, 'backward') == \
            (4, 64)
        assert dispatch.core_launch(32, 'forward') == (4, 64)  # not given: as before
        assert dispatch.core_launch(64, 'forward') == (8, 16)
        with dispatch.triton_core_launch(forward=(2, 128)):
            assert dispatch.core_launch(12) == (2, 128)
            assert dispatch.core_launch(12, 'backward') == (4, 64)  # the outer block's
        assert dispatch.core_launch(12) == (4, 64)
    assert dispatch.core_launch(32, 'backward') == (8, 32)
    for bad in ((3, 64), (4, 48), (4, 8)):
        with pytest.raises(ValueError, match=r'backward launch must be \(warps in 1, 2, 4, 8, '
                                             r'16; block a power of two >= 16\), got '):
            with dispatch.triton_core_launch(backward=bad):
                pass
    assert dispatch.core_launch(32, 'backward') == (8, 32)


@pytest.mark.skipif(dispatch.triton_module() is None, reason='Triton is not installed')
@pytest.mark.parametrize('family', ['pola', 'nala'])
def test_the_cores_launch_each_phase_as_core_launch_says(monkeypatch, family):
    # the kernels of the forward launch with the forward's warps and blocks, those of the
    # backward with the backward's (blocks given to the core function replace both phases'
    # blocks, not the warps); recorded, not run
    from linattn_mm.ops.nala import triton as nt
    from linattn_mm.ops.pola import triton as pt
    module = pt if family == 'pola' else nt
    launched = []

    def record(kernel, grid, *args, num_warps, **kwargs):
        block = kwargs.get('BLOCK_N', kwargs.get('BLOCK_M'))
        launched.append((kernel.fn.__name__.lstrip('_'), num_warps, block))

    monkeypatch.setattr(dispatch, '_interpreting', lambda: True)  # CPU tensors pass the checks
    monkeypatch.setattr(module, 'launch_fitted', record)

    def step(d, **blocks):
        del launched[:]
        q, k, v = (torch.randn(1, 2, 40, d, requires_grad=True) for _ in range(3))
        if family == 'pola':
            out = pt.polarity_attention_triton(q, k, v, torch.full((1, 2, 1, d), 3.0), **blocks)
        else:
            out = nt.nala_attention_triton(q, k, v, **blocks)
        out.sum().backward()
        return launched

    forward = [f'{family}_keys_kernel', f'{family}_queries_kernel']
    backward = [f'{family}_query_grad_kernel', f'{family}_key_grad_kernel']
    names = forward + backward
    assert step(32) == [(n, 4, 64) for n in forward] + [(n, 8, 32) for n in backward]
    assert step(12) == [(n, 4, 64) for n in forward] + [(n, 8, 32) for n in backward]
    assert step(64) == [(n, 8, 16) for n in names]
    assert step(32, block_n=16, block_m=128) == [
        (names[0], 4, 16), (names[1], 4, 128), (names[2], 8, 128), (names[3], 8, 16)]
    with dispatch.triton_core_launch(backward=(4, 64)):
        assert step(32) == [(n, 4, 64) for n in names]


def test_a_block_sets_the_fused_forms_launch():
    # dispatch.fused_launch: the warps of the fused forms' kernels and the elements of the fused
    # cores' tiles (tokens per tile: elements over the padded head dim, at least 16)
    assert dispatch.fused_warps() == dispatch.FUSED_WARPS == 4
    assert dispatch.fused_block(64) == 32 and dispatch.fused_block(12) == 128
    with dispatch.fused_launch(warps=8):
        assert dispatch.fused_warps() == 8 and dispatch.fused_block(64) == 32
        with dispatch.fused_launch(block_elements=512):
            assert dispatch.fused_warps() == 8  # the outer block's
            assert dispatch.fused_block(64) == 16 and dispatch.fused_block(32) == 16
        assert dispatch.fused_block(64) == 32
    assert dispatch.fused_warps() == 4
    with pytest.raises(ValueError, match=r'warps must be 1, 2, 4, 8 or 16, got 3'):
        with dispatch.fused_launch(warps=3):
            pass
    for bad in (128, 768):
        with pytest.raises(ValueError, match=rf'block_elements must be a power of two >= 256, '
                                             rf'got {bad}'):
            with dispatch.fused_launch(block_elements=bad):
                pass
    assert dispatch.fused_warps() == 4 and dispatch.fused_block(64) == 32


@pytest.mark.skipif(dispatch.triton_module() is None, reason='Triton is not installed')
def test_the_fused_cores_launch_as_fused_launch_says(monkeypatch):
    # every kernel of the fused NaLa and Pola cores, forward and backward, launches with the
    # warps and the tiles of the block it runs in; recorded, not run
    from linattn_mm.ops.nala import fused as nf
    from linattn_mm.ops.pola import fused as pf
    launched = []

    def record(kernel, grid, *args, num_warps, **kwargs):
        launched.append((kernel.fn.__name__, num_warps, kwargs.get('BLOCK')))

    monkeypatch.setattr(dispatch, '_interpreting', lambda: True)  # CPU tensors pass the checks
    monkeypatch.setattr(nf, 'launch_fitted', record)
    monkeypatch.setattr(pf, 'launch_fitted', record)

    def launches(core):
        del launched[:]
        q, k, v = (torch.randn(1, 2, 40, 64, requires_grad=True) for _ in range(3))
        if core == 'nala':
            out = nf.nala_attention_fused(q, k, v)
        else:
            out = pf.polarity_attention_fused(q, k, v, torch.full((1, 2, 1, 64), 3.0))
        out.sum().backward()  # on the buffers the recorded launches left unwritten
        return {(name, warps, block) for name, warps, block in launched}

    kernels = {'nala': ['_nala_fused_features_kernel', '_nala_fused_query_grads_kernel',
                        '_nala_fused_key_grads_kernel'],
               'pola': ['_pola_features_kernel', '_pola_output_grad_kernel',
                        '_pola_feature_grads_kernel']}
    for core, names in kernels.items():
        assert launches(core) == {(n, 4, 32) for n in names}
        with dispatch.fused_launch(8, 512):
            assert launches(core) == {(n, 8, 16) for n in names}
