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
