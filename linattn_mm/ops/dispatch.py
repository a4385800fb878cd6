"""Which attention cores exist, whether the Triton kernels can run here, and the memory of a
Triton failure.

Every linear family exposes its kernels behind one signature and a ``core`` name (``'reference'``,
``'fast'``, ``'fused'``, ``'triton'``) that a mixer fixes at construction and
:func:`linattn_mm.deploy.convert` may change once for inference; nothing here looks at a call's
device or gradient to choose. The Triton kernels are CUDA kernels (Triton's interpreter runs them
on CPU tensors under ``TRITON_INTERPRET=1``): forward and backward of Pola's and of NaLa's
(official kernel), and the elementwise kernels of their fused cores; Triton is imported on first
use only.
"""
import contextlib
import os
import warnings

import torch

__all__ = ['CORES', 'check_core', 'TRITON_DTYPES', 'triton_module', 'triton_available',
           'TRITON_FAILURES', 'note_triton_failure', 'launch_fitted', 'shared_memory_limit',
           'DOT_PRECISIONS', 'dot_precision', 'triton_dot_precision', 'core_launch',
           'CORE_LAUNCHES', 'core_blocks', 'triton_core_launch', 'padded_head_dims',
           'FUSED_BLOCK_ELEMENTS', 'FUSED_WARPS', 'FUSED_PROGRAMS_PER_SM', 'fused_block',
           'fused_chunks', 'multiprocessors', 'fused_warps', 'fused_launch']

#: the names of the attention cores of the linear families (``'fused'`` and ``'triton'``: Pola's
#: and NaLa's official kernel)
CORES = ('reference', 'fast', 'fused', 'triton')

#: input dtypes the Triton kernels read
TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

#: the errors of Triton calls made by converted modules in this process (a failing compiler or
#: driver makes them run their torch kernel from then on; see :func:`note_triton_failure`)
TRITON_FAILURES = []


def check_core(owner, core, available=CORES):
    """The core name ``core`` of a mixer, or a ``ValueError`` naming the valid ones."""
    if core not in available:
        raise ValueError(f'{owner}: core must be one of {tuple(available)}, got {core!r}')
    return core


def triton_module():
    """The ``triton`` package, or None when it is not installed (or not importable)."""
    try:
        import triton
    except Exception:  # pragma: no cover - depends on the installation
        return None
    return triton


def _interpreting():
    return os.environ.get('TRITON_INTERPRET') == '1'


def triton_available(device=None):
    """True when the Triton kernels can run on ``device`` (a ``torch.device``, a string, a tensor
    or None for "any"): Triton is installed and the device is CUDA, or Triton's interpreter is on
    (``TRITON_INTERPRET=1``, any device)."""
    if triton_module() is None:
        return False
    if isinstance(device, torch.Tensor):
        device = device.device
    if device is None:
        return torch.cuda.is_available() or _interpreting()
    return torch.device(device).type == 'cuda' or _interpreting()


def note_triton_failure(owner, exc):
    """Record ``exc`` of a converted module's Triton call in :data:`TRITON_FAILURES` and warn that
    its torch kernel runs instead."""
    TRITON_FAILURES.append(f'{type(exc).__name__}: {exc}')
    warnings.warn(f'{owner}: the Triton kernel failed ({TRITON_FAILURES[-1][:500]}); the torch '
                  f"kernel runs instead from now on (core='triton' on the module raises the "
                  f'error)', stacklevel=3)


def padded_head_dims(d):
    """The head dim ``d`` the Triton kernels pad to: a power of two, at least 16."""
    return max(16, 1 << (int(d) - 1).bit_length())


#: ``(num_warps, block)`` of the cores' kernels by phase (``'forward'``: the keys' and queries'
#: passes, also those of inference; ``'backward'``: the gradient passes), for padded head dims up
#: to 32 and above (see :func:`core_launch`)
CORE_LAUNCHES = {'forward': ((4, 64), (8, 16)), 'backward': ((8, 32), (8, 16))}
# a stack of launch overrides for the whole process (the backward of CUDA autograd runs on a
# thread of its own), see :func:`triton_core_launch` and :func:`fused_launch`
_LAUNCH_OVERRIDES = [{}]


def core_launch(d, phase='forward'):
    """``(num_warps, block)`` of the Pola and NaLa cores' kernels of ``phase`` (``'forward'`` or
    ``'backward'``) at head dim ``d`` (by its padded dim ``DP``, :func:`padded_head_dims`;
    :data:`CORE_LAUNCHES`): the warps of a program and the tokens it takes per step (blocks given
    to a core function replace the latter in both phases; the warps still follow the head dim).

    A program holds (DP × DP) float32 accumulators; Triton lowers their float32 products to FMA
    loops whose operands live in registers. Assembled for ``sm_90`` (``ptxas -v``, Pola with its
    position encoding and temperature, NaLa with the RoPE):

    - DP = 64: with 4 warps and blocks of 64 tokens (NaLa's gradients and keys with 8 warps) each
      of the eight kernels spilled about 2 to 50 KB per thread to local memory with bf16 inputs
      (the torch core was faster there on an H200); with 8 warps and blocks of 16, six of the
      eight spill nothing and the other two 84 and 556 bytes (float32 inputs: up to about 1.6 KB),
      and most need half the shared memory or less (since 0.6.11).
    - DP <= 32, gradient passes: with 4 warps and blocks of 64 the Pola query and key gradients
      spill 1948 and 0 bytes per thread with bf16 inputs, 10228 and 100 with float32 inputs,
      NaLa's 1928 and 716 (bf16), 1800 and 10752 (float32; the two kernels of about 10 KB get 32
      registers, the others 255); with 8 warps and blocks of 32 (128-204 registers) none spills
      and each needs a little over half the shared memory (since 0.6.12).
    - DP <= 32, forward passes: 4 warps and blocks of 64, the launch measured on the H200 (at most
      64 bytes of spills with bf16 inputs).

    DP = 128 takes the launch of 64 unchecked. Not measured on a GPU yet: the launches of DP = 64
    and the gradient passes' of DP <= 32 (:func:`triton_core_launch` sets others for a
    comparison)."""
    if phase not in CORE_LAUNCHES:
        raise ValueError(f'core_launch: phase must be one of {tuple(CORE_LAUNCHES)}, got '
                         f'{phase!r}')
    override = _LAUNCH_OVERRIDES[-1].get(phase)
    if override is not None:
        return override
    small, large = CORE_LAUNCHES[phase]
    return small if padded_head_dims(d) <= 32 else large


def core_blocks(d, phase, block_n=None, block_m=None):
    """The keys' and queries' blocks of ``phase`` at head dim ``d``: those given, else
    :func:`core_launch`'s."""
    block = core_launch(d, phase)[1]
    return block_n or block, block_m or block


@contextlib.contextmanager
def triton_core_launch(forward=None, backward=None):
    """Within the block, the Triton cores' kernels of each phase given launch with that
    ``(num_warps, block)`` at every head dim instead of :func:`core_launch`'s (blocks given to a
    core function still replace the block): a switch to compare launches on a GPU
    (``tools/benchmark.py --mode core --impls triton-w4b64``), not a setting to train with. The
    backward reads it when it runs. One setting for the whole process (the backward of CUDA
    autograd runs on a thread of its own): not for blocks entered concurrently by several threads.
    The cores read it when they launch: put the block around a call of a ``torch.compile``-d
    function, not inside it (a compiled graph does not see a change made within it)."""
    launches = {}
    for phase, launch in (('forward', forward), ('backward', backward)):
        if launch is None:
            continue
        warps, block = launch
        if warps not in (1, 2, 4, 8, 16) or block < 16 or block & (block - 1):
            raise ValueError(f'triton_core_launch: {phase} launch must be (warps in 1, 2, 4, 8, '
                             f'16; block a power of two >= 16), got {launch!r}')
        launches[phase] = (int(warps), int(block))
    with _launch_overrides(launches):
        yield


@contextlib.contextmanager
def _launch_overrides(values):
    """Within the block, ``values`` (keys: a Triton core's phase, or ``'fused_warps'`` and
    ``'fused_block_elements'``) replace those of the enclosing blocks in
    :data:`_LAUNCH_OVERRIDES` (:func:`triton_core_launch`, :func:`fused_launch`)."""
    _LAUNCH_OVERRIDES.append(dict(_LAUNCH_OVERRIDES[-1], **values))
    try:
        yield
    finally:
        _LAUNCH_OVERRIDES.pop()


#: elements of one tile (tokens × padded head dim) of the fused cores' elementwise kernels
#: (:mod:`linattn_mm.ops.pola.fused`, :mod:`linattn_mm.ops.nala.fused`), with
#: :data:`FUSED_WARPS` warps: 16 float32 values per thread and map
FUSED_BLOCK_ELEMENTS = 2048
#: warps of every program of the fused forms' kernels (the cores', NaLaFormer's conv sums, gated
#: output and RoPE)
FUSED_WARPS = 4
#: programs per multiprocessor of the fused cores' kernels that sum over their chunk of tokens:
#: memory-bound kernels want many warps in flight on every multiprocessor
FUSED_PROGRAMS_PER_SM = 16

def fused_warps():
    """Warps of a program of the fused forms' kernels: :data:`FUSED_WARPS`, or what
    :func:`fused_launch` sets."""
    return _LAUNCH_OVERRIDES[-1].get('fused_warps', FUSED_WARPS)


@contextlib.contextmanager
def fused_launch(warps=None, block_elements=None):
    """Within the block, the fused forms' kernels launch with ``warps`` warps per program
    (:func:`fused_warps`) and the fused cores' tiles hold ``block_elements`` elements
    (:func:`fused_block`) instead of :data:`FUSED_WARPS` and :data:`FUSED_BLOCK_ELEMENTS`: a
    switch to compare launches on a GPU (``tools/benchmark.py --fused-launch``), not a setting to
    train with. The values are the same; registers per thread, and so the warps a
    multiprocessor holds at once, change with the tile a thread holds.

    The kernels read it when they launch, the backward's when it runs: one setting for the whole
    process (as :func:`triton_core_launch`)."""
    launch = {}
    if warps is not None:
        if warps not in (1, 2, 4, 8, 16):
            raise ValueError(f'fused_launch: warps must be 1, 2, 4, 8 or 16, got {warps!r}')
        launch['fused_warps'] = int(warps)
    if block_elements is not None:
        if block_elements < 256 or block_elements & (block_elements - 1):
            raise ValueError(f'fused_launch: block_elements must be a power of two >= 256, got '
                             f'{block_elements!r}')
        launch['fused_block_elements'] = int(block_elements)
    with _launch_overrides(launch):
        yield


def multiprocessors(device):
    """The multiprocessors of the CUDA ``device`` (4 for any other device: the grids of the
    interpreter's and ``meta``'s launches)."""
    if device.type != 'cuda':
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def fused_block(d):
    """Tokens of a tile of the fused cores' kernels at head dim ``d``:
    :data:`FUSED_BLOCK_ELEMENTS` (or :func:`fused_launch`'s) over the padded dim
    (:func:`padded_head_dims`)."""
    elements = _LAUNCH_OVERRIDES[-1].get('fused_block_elements', FUSED_BLOCK_ELEMENTS)
    return max(16, elements // padded_head_dims(d))


def fused_chunks(length, bh, block, device):
    """``(programs, tokens)`` per (batch, head) of a fused core's kernel over ``length`` tokens in
    blocks of ``block``: about :data:`FUSED_PROGRAMS_PER_SM` programs per multiprocessor of the
    CUDA ``device`` in all (4 multiprocessors elsewhere), each taking a whole number of blocks."""
    blocks = -(-length // block)
    per_bh = max(1, min(blocks, -(-FUSED_PROGRAMS_PER_SM * multiprocessors(device) // bh)))
    chunk = -(-blocks // per_bh) * block
    return -(-length // chunk), chunk


#: pipeline stages chosen by :func:`launch_fitted`, per kernel, launch options, device and the
#: arguments' specialization
_FITTED_STAGES = {}


def shared_memory_limit(device):
    """Bytes of shared memory one program (thread block) may use on the CUDA ``device``."""
    return torch.cuda.get_device_properties(device).shared_memory_per_block_optin


def _stage_limit(device):
    """The shared memory per program that :func:`launch_fitted` fits the stages to on ``device``;
    None (launch as asked) off CUDA and under Triton's interpreter."""
    if _interpreting() or device.type != 'cuda':
        return None
    return shared_memory_limit(device)


def _specialization(args):
    """What of the arguments, besides the constexprs, decides which kernel Triton compiles (and
    so its shared memory): the tensors' dtypes and 16-byte alignment, the integers' divisibility
    by 16 and being 1."""
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append((a.dtype, a.data_ptr() % 16 == 0))
        elif isinstance(a, int) and not isinstance(a, bool):
            out.append((a % 16 == 0, a == 1))
        else:
            out.append(type(a))
    return tuple(out)


def launch_fitted(kernel, grid, *args, num_stages=3, **kwargs):
    """``kernel[grid](*args, **kwargs)`` with the most software-pipeline stages, from
    ``num_stages`` down to 1, whose compiled kernel fits the shared memory of the device of the
    first tensor argument (:func:`shared_memory_limit`).

    A kernel's shared memory grows with its stages and tiles and the limit differs between GPUs
    (227 KB per block on Hopper, 163 KB on the A100, 99 KB on most other recent cards), so one fixed
    choice either leaves Hopper's pipelining unused or does not launch elsewhere. The choice is
    made once per kernel, options, device and specialization of the arguments (dtypes and
    alignment, as Triton specializes its kernels) by compiling (not launching) each candidate; a
    kernel that does not fit with one stage raises a ``RuntimeError`` that names it, its shared
    memory and the device's. Under Triton's interpreter the kernel runs as asked."""
    device = next(a.device for a in args if isinstance(a, torch.Tensor))
    limit = _stage_limit(device)
    if limit is None:
        return kernel[grid](*args, num_stages=num_stages, **kwargs)
    key = (kernel, tuple(sorted(kwargs.items())), num_stages, device, _specialization(args))
    stages = _FITTED_STAGES.get(key)
    if stages is None:
        for stages in range(num_stages, 0, -1):
            shared = kernel.warmup(*args, grid=grid, num_stages=stages, **kwargs).metadata.shared
            if shared <= limit:
                break
        else:
            name = getattr(getattr(kernel, 'fn', None), '__name__', repr(kernel))
            prec = kwargs.get('PREC', 'ieee')
            hint = '' if prec == 'ieee' else \
                f" or the default precision of the products ('ieee', not {prec!r})"
            raise RuntimeError(
                f'{name}: needs {shared} bytes of shared memory per program with one pipeline '
                f"stage, and {device} allows {limit}; use the torch core (core='fast') on this "
                f'GPU{hint}')
        _FITTED_STAGES[key] = stages
    return kernel[grid](*args, num_stages=stages, **kwargs)


#: precisions of the Triton cores' float32 products (``tl.dot``'s ``input_precision``): ``'ieee'``
#: (float32 arithmetic, the default: the tests hold the cores to float32 error), ``'tf32x3'``
#: (three TF32 products on the tensor cores, about float32's accuracy), ``'tf32'`` (one; about
#: 1e-3 relative)
DOT_PRECISIONS = ('ieee', 'tf32x3', 'tf32')
# one stack for the process, not per thread: on CUDA autograd runs the backward on a thread of its
# own, which must see the precision of the block that runs it
_DOT_PRECISION = ['ieee']


def dot_precision():
    """The precision the Triton cores' products are compiled with now (:data:`DOT_PRECISIONS`)."""
    return _DOT_PRECISION[-1]


@contextlib.contextmanager
def triton_dot_precision(precision):
    """Within the block, the Triton cores launched (forward, and backward when it runs inside)
    compile their products with ``precision`` (one of :data:`DOT_PRECISIONS`; each is a kernel of
    its own, compiled on first use). Leaves the default, ``'ieee'``, everywhere else. The cores read
    it when they launch: put the block around a call of a ``torch.compile``-d function, not inside
    it (a compiled graph does not see a change made within it)."""
    if precision not in DOT_PRECISIONS:
        raise ValueError(f'triton_dot_precision: precision must be one of {DOT_PRECISIONS}, got '
                         f'{precision!r}')
    _DOT_PRECISION.append(precision)
    try:
        yield
    finally:
        _DOT_PRECISION.pop()
