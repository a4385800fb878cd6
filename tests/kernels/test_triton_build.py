"""The Triton kernels of the Pola and NaLa cores compiled for real GPUs without one: Hopper
(H100 / H200, 227 KB of shared memory per program), the A100 (163 KB) and the 99 KB of most other
recent cards, through Triton's compiler and ``ptxas`` (``tests/kernels/triton_build_checks.py``).

Triton's interpreter, which checks the kernels' values on CPU, neither compiles them nor knows a
GPU's limits: three pipeline stages of the NaLa query gradients at head dim 64 with the RoPE
(NaLaFormer-T's stages 1-2) need about 280 KB and did not launch on an H200.
:func:`linattn_mm.ops.dispatch.launch_fitted` fits the stages to the device; these tests hold every
launch of a forward and backward to the device's limit, and a kernel that cannot fit to an error
that names it."""
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
    """arch -> the script's launches, the three architectures compiled side by side."""
    env = dict(os.environ, PYTHONWARNINGS='ignore',
               TRITON_CACHE_DIR=str(tmp_path_factory.mktemp('triton_cache')),
               PYTHONPATH=os.pathsep.join(p for p in (osp.join(REPO, 'tests'),
                                                      os.environ.get('PYTHONPATH')) if p))
    env.pop('TRITON_INTERPRET', None)
    script = osp.join(REPO, 'tests', 'kernels', 'triton_build_checks.py')
    procs = {arch: subprocess.Popen([sys.executable, script, str(arch), str(limit)], env=env,
                                    cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True) for arch, limit in GPUS.items()}
    out = {}
    for arch, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=900)
        assert proc.returncode == 0, stderr[-3000:]
        out[arch] = json.loads(stdout)
    if any(isinstance(r, dict) for r in out.values()):
        pytest.skip(next(r for r in out.values() if isinstance(r, dict))['unsupported'])
    return out


def _cases(results):
    cases = {}
    for case, *launch in results:
        cases.setdefault(case, []).append(launch)
    return cases


@pytest.mark.parametrize('arch', sorted(GPUS))
def test_every_launch_fits_the_shared_memory(builds, arch):
    cases = _cases(builds[arch])
    assert len(cases) == 8
    for case, launches in cases.items():
        if arch == 86 and case == 'nala d64 fp32 rope':
            continue  # the next test
        family = case.split()[0]
        # forward and backward: the four kernels, each launched once
        assert [name for name, *_ in launches] == KERNELS[family], (case, launches)
        for name, stages, shared in launches:
            assert 1 <= stages <= 3, (case, name, stages)
            assert 0 < shared <= GPUS[arch], (case, name, shared)


def test_hopper_keeps_pipelining_everywhere(builds):
    # fitting takes stages away only where they do not fit: on Hopper every kernel keeps at
    # least two, and the NaLa query gradients at d = 64 with the RoPE lose the third (which
    # does not fit: the reason launch_fitted exists)
    launches = {(case, name): (stages, shared) for case, name, stages, shared in builds[90]}
    assert all(stages >= 2 for stages, _ in launches.values()), launches
    assert launches[('nala d64 fp32 rope', '_nala_query_grad_kernel')][0] < 3
    assert sum(stages == 3 for stages, _ in launches.values()) >= len(launches) - 2


def test_a_kernel_that_cannot_fit_is_named(builds):
    # on a 99 KB card the NaLa query gradients at d = 64 with the RoPE need more than that even
    # with one stage: the error names the kernel, its need and the limit, before any launch of it
    cases = _cases(builds[86])
    launches = cases['nala d64 fp32 rope']
    errors = [launch for launch in launches if launch[0] == 'error']
    assert len(errors) == 1
    message = errors[0][1]
    assert message.startswith('_nala_query_grad_kernel: needs ')
    need = int(message.split('needs ')[1].split()[0])
    assert need > GPUS[86] and f'allows {GPUS[86]}' in message and "core='fast'" in message
    # the forward ran (its two kernels fitted), the backward stopped at the query gradients
    assert [launch[0] for launch in launches if launch[0] != 'error'] == KERNELS['nala'][:2]
