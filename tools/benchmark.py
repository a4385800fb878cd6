"""Speed and peak memory of backbones, whole models and the Pola attention layer, over input sizes.

    # backbones: built-in names (see --list) or config files (their model.backbone)
    python tools/benchmark.py --mode backbone pola-swin-t swin-t --sizes 800x1344 --compare swin-t
    # whole detector / segmentor / classifier from a config (forward mode tensor or predict)
    python tools/benchmark.py --mode model configs/polaformer/pola-pvt-t_in1k.py --sizes 224 \\
        --batch 8 --impls fast official --compare official
    # the Pola attention layer alone at N = H*W tokens
    python tools/benchmark.py --mode attention --grid 128x128 --heads 3 --head-dims 32 \\
        --impls fast official reference --compare official
    # training steps (train mode, forward, loss, backward) of backbones against the stock ones,
    # and of whole detectors / segmentors from configs with their real losses
    python tools/benchmark.py --mode train pola-swin-t swin-t linattn-swin-t --sizes 800x1344 \
        --compare swin-t
    python tools/benchmark.py --mode train configs/swin/mask-rcnn_swin-t_fpn_1x_coco.py \
        configs/polaformer/mask-rcnn_pola-swin-t_fpn_1x_coco.py --part model --sizes 800x1344
    # the attention core alone (q, k, v in, normalised streams out): time, memory traffic and
    # achieved bandwidth (on CUDA, as a fraction of the device's peak)
    python tools/benchmark.py --mode core --device cuda --dtype bf16 --grid 128x128 256x256 \\
        --batch 8 --impls triton torch --compare torch

Options: ``--device cpu|cuda``, ``--dtype fp32|bf16|fp16`` (autocast), ``--batch``, ``--sizes``
(``S`` = S x S or ``HxW``; a sweep), ``--warmup``, ``--repeats`` (the median is reported),
``--threads`` (CPU), ``--json FILE``, ``--plot FILE`` (log-log time and peak memory against
pixels, with the fitted slope per target).

Implementations of the Pola and NaLa mixers (``--impls``, every target is run with each one,
same weights, same inputs, and outputs are compared with the first):

* ``fast``: the plugin's default for inference: the model converted by
  :func:`linattn_mm.deploy.convert` (CPU: whole Pola / NaLa layers chunk by chunk, fused FFN, window
  attention in groups, GEMM patch embedding, NaLaFormer's in-place blocks; CUDA: the Triton cores).
* ``torch``: the unconverted model with the torch fast kernels :mod:`linattn_mm.ops.pola.fast` /
  :mod:`linattn_mm.ops.nala.fast` (``core='fast'``, what training runs).
* ``fused``: the unconverted model with the Pola and NaLa mixers on their fused cores
  (:mod:`linattn_mm.ops.pola.fused`, :mod:`linattn_mm.ops.nala.fused`: the torch cores'
  products, their elementwise passes as Triton kernels; CUDA, or ``meta`` to count; NaLa mixers
  whose feature map has no fused core keep ``core='fast'``).
* ``triton``: the model converted for CUDA (the Triton cores; CUDA only).
* ``reference``: the unconverted model with the reference cores (``core='reference'``).
* ``official``: a straightforward implementation of the official forward written in this file
  from the pseudo-code of the official code (two relu-pow per tensor, two streams each with its
  own GEMMs and normalisers, ``n^-1/2`` rescaling, ``cat`` copies, NCHW depth-wise conv); it is
  bound to every ``PolaLinearAttention`` of the unconverted model in place of its ``forward``, so
  it uses the same weights (NaLa mixers run their reference core).

``--ffn plain`` keeps the blocks of the converted implementations unconverted (plain FFN), so
that the mixers alone are compared.

``--compare BASELINE`` (a target name or an implementation name, measured in the same run) prints
time ratios ``baseline / this`` (> 1: faster than the baseline) per size.

Reported: latency (median ms per forward), img/s (batch / latency) and peak memory. On CUDA the
peak is ``torch.cuda.max_memory_allocated`` during one forward; on CPU it is the peak of live
tensor storage counted by :class:`linattn_mm.utils.PeakMemoryCounter` during one extra
(untimed) forward, not counting the weights and the input. All forwards run in ``eval`` mode under
``torch.inference_mode``.

``--mode train`` times training steps instead, every target built first and the targets' steps
run in interleaved rounds (A, B, C, A, B, C, ...; the other modes measure one target after the
other): ``train`` mode, the forward, a loss (a backbone:
``sum(mean(out^2))`` over its outputs; ``--part model``: the model's own losses on a synthetic
batch with demo-shaped annotations, :func:`linattn_mm.utils.synthetic.training_batch`) and the
backward, the gradients of the previous step cleared first. Nothing is converted: the models run
their default training forms (the lean autograd Functions of :mod:`linattn_mm.ops`; ``--impls
reference`` runs plain autograd of the reference forms). The peak memory is that of one extra
step: everything autograd keeps for the backward, the gradients and the backward's temporaries
(the weights, the input and the gradients' previous values not counted).

``--profile N`` (any mode but ``--device meta``): after the timings, N more calls of each
target and implementation (forwards, training steps, core calls) under ``torch.profiler``, and
the table of the operations and kernels that took the most time of their own (GPU time on CUDA).
``--log-progress`` writes each build, warm-up, the timed rounds and each memory run to stderr with
the seconds since the start: a run stopped by a time limit shows how far it came.

``--mmcv-ops torchvision`` runs the detectors' NMS and RoIAlign on torchvision's kernels in
place of mmcv's compiled ones (:class:`TorchvisionMmcvOps`; the same results): for timing a
detector on a GPU where mmcv was built without its CUDA ops.

``--device meta`` (with ``--mode train``) runs the training steps on ``meta`` tensors:
shapes only, nothing computed, on a machine without a GPU. The models take the paths they take
on a GPU (one chunk, the sums over the tokens in parts), and the tool reports the operations of
a step (``--count-ops``, :class:`linattn_mm.utils.OperationCounter`) and its peak of live tensor
storage (:class:`~linattn_mm.utils.PeakMemoryCounter` counting meta tensors: what the GPU path
keeps alive, without the caching allocator's rounding), no time; also the bytes the step's
operations move and their FLOPs (:class:`~linattn_mm.utils.TrafficCounter`), and with
``--roofline GPU`` a lower bound of the step's time on that GPU (each operation at least its bytes
over the memory bandwidth and its FLOPs over the peak rate). ``--dtype bf16`` / ``fp16`` run the
forward there under CUDA's autocast (:func:`linattn_mm.utils.meta_autocast`: the same casts, the
same dtypes, the weights' casts made once per step). ``F.scaled_dot_product_attention`` runs
there as the fused kernel a GPU runs (``aten._scaled_dot_product_efficient_attention`` in float32
or with a mask, ``aten._scaled_dot_product_flash_attention`` in half precision without one; torch
knows their shapes on meta): its decomposition would count the (N, N) attention matrices of the
global softmax stages.

``--ops-by-module N`` (``--mode train``) counts the operations of each target's step (as
``--count-ops``) also by module class (:class:`~linattn_mm.utils.OperationsByModule`: forward
operations for the innermost module running, backward ones for the module whose forward made the
autograd node) and prints the ``N`` entries with the most operations under the target's row, with
the bytes they move.

``--compile [BACKEND]`` (``--mode train``, backbones) compiles each backbone with
``torch.compile`` (``inductor`` by default) and times its compiled training steps; the warm-up
steps compile. Off CUDA no peak memory is reported for them (the CPU counter is a dispatch mode,
under which the step would run eager).

``--mode core`` times the attention core alone on random ``q, k, v`` of shape (batch, heads,
H*W, head dims) in ``--dtype`` (real tensors of that dtype, not autocast), with the temperature and
a position encoding as in the module (``--impls`` among ``triton``, ``torch``, ``reference``). It
reports the bytes the core must move at least (read q, k, v and the position encoding once, write
the output once) divided by the time: the achieved memory bandwidth. On CUDA this is also given as
a fraction of the device's peak (``--peak-bw`` in GB/s, or known for H100 / H200).
``--attn nala`` times the NaLa core instead (official kernel, ``lam = 3``, with the 2-D RoPE;
``--impls`` among ``triton``, ``torch``, ``reference``). ``--backward`` times a training step of
the core (its forward and its backward with a fixed output gradient; every input needs a
gradient); the least traffic then adds q, k, v and the output's gradient read and dq, dk, dv
written once (Pola: the position encoding read twice and its gradient written once).
"""
import argparse
import contextlib
import gc
import json
import math
import os
import os.path as osp
import statistics
import sys
import time
import types

import torch
import torch.nn.functional as F

import linattn_mm  # noqa: F401
from linattn_mm import deploy
from linattn_mm.cli import set_fused_forms
from linattn_mm.flops import dummy_inputs
from linattn_mm.models.attentions.nala import NormAwareLinearAttention, RoPE2d
from linattn_mm.models.attentions.pola import PolaLinearAttention
from linattn_mm.models.utils.layers import TransformerBlock
from linattn_mm.models.backbones.nalaformer import NaLaBlock
from linattn_mm.ops.common import autocast_on, no_autocast
from linattn_mm.ops.dispatch import padded_head_dims, triton_available
from linattn_mm.ops.nala import core_refusal
from linattn_mm.utils import (OperationsByModule, PeakMemoryCounter, TrafficCounter, meta_autocast,
                              use_heap_allocator)
from linattn_mm.utils.autocast_meta import autocast_args
from linattn_mm.utils.progress import emit, progress_bar

POLA_PVT = dict(type='PolaLinearAttention', qkv_layout='qg_kv', alpha=4, kernel_size=5,
                la_sr_ratio=1)
POLA_SWIN = dict(type='PolaLinearAttention', qkv_layout='qkvg', alpha=4, kernel_size=5)
WIN7 = dict(type='WindowSoftmaxAttention', window_size=7)

#: built-in backbones: name -> (config dict, description)
BACKBONES = {
    'pola-pvt-t': (dict(type='LinAttnPVT', arch='t', attn_cfg=POLA_PVT),
                   'Pola-PVT-T (linattn LinAttnPVT, Pola attention in all stages, la_sr 1)'),
    'pola-pvt-s': (dict(type='LinAttnPVT', arch='s', attn_cfg=POLA_PVT), 'Pola-PVT-S'),
    'pola-swin-t': (dict(type='LinAttnSwin', arch='t',
                         attn_cfg=[POLA_SWIN, POLA_SWIN, WIN7, WIN7]),
                    'Pola-Swin-T (LinAttnSwin, global Pola stages 1-2, window-7 stages 3-4)'),
    'swin-t': (dict(type='mmdet.SwinTransformer', embed_dims=96, depths=(2, 2, 6, 2),
                    num_heads=(3, 6, 12, 24), window_size=7),
               'stock mmdet SwinTransformer, Swin-T arch'),
    'pvt-t': (dict(type='mmdet.PyramidVisionTransformer', num_layers=[2, 2, 2, 2]),
              'stock mmdet PyramidVisionTransformer, PVT-T arch (SRA softmax, sr 8/4/2/1)'),
    'linattn-swin-t': (dict(type='LinAttnSwin', arch='t'),
                       'LinAttnSwin-T with window-7 softmax attention (Swin-T in the skeleton)'),
    'linattn-pvt-t': (dict(type='LinAttnPVT', arch='t',
                           attn_cfg=dict(type='SRSoftmaxAttention')),
                      'LinAttnPVT-T with SRA softmax (PVT-T in the skeleton)'),
    'global-pvt-t': (dict(type='LinAttnPVT', arch='t',
                          attn_cfg=dict(type='GlobalSoftmaxAttention')),
                     'LinAttnPVT-T with global softmax attention in every stage (quadratic)'),
    'nalaformer-t': (dict(type='NaLaFormer', arch='t'),
                     'NaLaFormer-T (linear NaLa stages 1-2, global softmax stages 3-4)'),
    'nalaformer-t-linear': (dict(type='NaLaFormer', arch='t',
                                 attn_cfg=dict(type='NormAwareLinearAttention')),
                            'NaLaFormer-T with NaLa linear attention in all four stages'),
}

POLA_IMPLS = ('fast', 'torch', 'fused', 'triton', 'reference', 'official')
#: the mixers' ``core`` under each implementation (``fast`` / ``triton`` then convert the model)
CORE = {'fast': 'fast', 'torch': 'fast', 'fused': 'fused', 'triton': 'fast',
        'reference': 'reference', 'official': 'reference'}
#: peak memory bandwidth (GB/s) by device name (first match; PCIe before the SXM default)
PEAK_BW = (('H100 PCIe', 2000.), ('H100 NVL', 3900.), ('H100', 3350.), ('H200', 4800.),
           ('A100-SXM4-80GB', 2039.), ('A100', 1555.))


# ------------------------------------------------------------------------------------------------
# the straightforward official forward (the official code's order of operations,
# ZacharyMeng/PolaFormer), bound in place of forward()
# ------------------------------------------------------------------------------------------------
def official_pola_forward(self, x, hw_shape):
    """PolaFormer attention as the official code computes it, written out directly: q, k, v, g
    from the projections, PE on k, temperature, relu(+-x)**p twice per tensor, the same-signed and
    opposite-signed streams each with their own GEMMs, normaliser and ``n^-1/2`` rescaling, cat,
    head-shared depth-wise conv on V (NCHW), gate, proj. Uses ``self``'s weights."""
    if self.num_extra_tokens or self.gate_type != 'dynamic' or not self.temperature \
            or not self.use_pos_enc or not self.use_dwc:
        raise NotImplementedError('official forward: dynamic gate, temperature, PE, the conv '
                                  'term, no class tokens only')
    B, N, C = x.shape
    H, W = hw_shape
    h = self.num_heads
    if self.qkv_layout == 'qkvg':
        q, k, v, g = self.qkvg(x).reshape(B, N, 4, C).permute(2, 0, 1, 3).unbind(0)
        kv_hw = (H, W)
    else:
        q, g = self.qg(x).reshape(B, N, 2, C).unbind(2)
        if self.la_sr_ratio > 1:
            x_ = x.permute(0, 2, 1).reshape(B, C, H, W)
            x_ = self.sr(x_)
            kv_hw = tuple(x_.shape[-2:])
            x_ = self.norm(x_.reshape(B, C, -1).permute(0, 2, 1))
        else:
            x_, kv_hw = x, (H, W)
        k, v = self.kv(x_).reshape(B, -1, 2, C).permute(2, 0, 1, 3).unbind(0)
    n = k.shape[1]
    k = k + self.pos_enc(kv_hw)
    scale = F.softplus(self.scale)
    power = 1 + self.alpha * torch.sigmoid(self.power)
    q = q / scale
    k = k / scale
    q = q.reshape(B, N, h, -1).permute(0, 2, 1, 3).contiguous()
    k = k.reshape(B, n, h, -1).permute(0, 2, 1, 3).contiguous()
    v = v.reshape(B, n, h, -1).permute(0, 2, 1, 3).contiguous()
    q_pos = F.relu(q) ** power
    q_neg = F.relu(-q) ** power
    k_pos = F.relu(k) ** power
    k_neg = F.relu(-k) ** power
    q_sim = torch.cat([q_pos, q_neg], dim=-1)
    q_opp = torch.cat([q_neg, q_pos], dim=-1)
    k = torch.cat([k_pos, k_neg], dim=-1)
    v1, v2 = torch.chunk(v, 2, dim=-1)
    z = 1 / (q_sim @ k.mean(dim=-2, keepdim=True).transpose(-2, -1) + self.eps)
    kv = (k.transpose(-2, -1) * (n ** -0.5)) @ (v1 * (n ** -0.5))
    x_sim = q_sim @ kv * z
    z = 1 / (q_opp @ k.mean(dim=-2, keepdim=True).transpose(-2, -1) + self.eps)
    kv = (k.transpose(-2, -1) * (n ** -0.5)) @ (v2 * (n ** -0.5))
    x_opp = q_opp @ kv * z
    out = torch.cat([x_sim, x_opp], dim=-1).transpose(1, 2).reshape(B, N, C)
    if n != H * W:
        v = F.interpolate(v.transpose(-2, -1).reshape(B * h, -1, n), size=N, mode='linear')
        v = v.reshape(B, h, -1, N).transpose(-2, -1)
    v = v.reshape(B * h, H, W, -1).permute(0, 3, 1, 2)
    v = self.dwc(v).reshape(B, C, N).permute(0, 2, 1)
    out = out + v
    out = out * g
    return self.proj_drop(self.proj(out))


def pola_modules(model):
    return [m for m in model.modules() if isinstance(m, PolaLinearAttention)]


def nala_modules(model):
    return [m for m in model.modules() if isinstance(m, NormAwareLinearAttention)]


def set_impl(model, impl, ffn='auto', device=None, train=False):
    """Give ``model`` the implementation ``impl`` (see the module docstring), undoing the previous
    one: ``fast`` and ``triton`` convert the model (:func:`linattn_mm.deploy.convert`, for CPU or
    CUDA), ``torch``, ``fused`` and ``reference`` leave it unconverted with the mixers' ``core``
    set to ``'fast'`` / ``'fused'`` / ``'reference'`` (``fused``: CUDA, or ``meta`` to count; NaLa
    mixers with a constant query power keep ``'fast'``; NaLaFormer blocks get their fused conv
    sums, ``ffn_core='fused'``, NaLa mixers their fused gated output), ``official``
    binds the official Pola forward (NaLa mixers: their reference core). ``ffn='plain'`` keeps
    the blocks unconverted (the mixers alone differ). For training (``train``) nothing is
    converted: ``fast`` is the default training form, ``triton`` puts the Pola and NaLa mixers
    (official kernel) on their Triton cores, forward and backward (CUDA, or ``meta`` to count
    what their kernels move)."""
    if train:
        impl = 'torch' if impl == 'fast' else impl
        if impl == 'triton':
            dev = torch.device(device or next(model.parameters()).device)
            if dev.type not in ('cuda', 'meta'):
                raise ValueError('--impls triton trains on --device cuda (or counts on meta)')
            deploy.revert(model)
            set_fused_forms(model, False)
            for m in pola_modules(model):  # an earlier 'official' variant's bound forward
                m.__dict__.pop('forward', None)
            for m in model.modules():
                if isinstance(m, PolaLinearAttention):
                    m.core = 'triton'
                elif isinstance(m, NormAwareLinearAttention):  # the paper's map has no Triton core
                    m.core = 'fast' if core_refusal('triton', m.kernel, m.query_power) else \
                        'triton'
            return
    if impl == 'fused':
        dev = torch.device(device or next(model.parameters()).device)
        if dev.type not in ('cuda', 'meta') and not triton_available(dev):
            raise ValueError('--impls fused runs on --device cuda (or counts on meta)')
    deploy.revert(model)
    for m in pola_modules(model):
        m.__dict__.pop('forward', None)
    for m in model.modules():
        if isinstance(m, PolaLinearAttention):
            m.core = CORE[impl]
        elif isinstance(m, NormAwareLinearAttention) and m.kernel == 'official':
            # the official map with a constant query power has no fused core
            m.core = 'fast' if core_refusal(CORE[impl], m.kernel, m.query_power) else CORE[impl]
    set_fused_forms(model, impl == 'fused')
    if impl == 'official':
        for m in pola_modules(model):
            m.forward = types.MethodType(official_pola_forward, m)
    if impl in ('fast', 'triton'):
        dev = device or next(model.parameters()).device
        if impl == 'triton' and torch.device(dev).type != 'cuda':
            raise ValueError('--impls triton needs --device cuda')
        deploy.convert(model, dev)
        if ffn == 'plain':
            for m in model.modules():
                if isinstance(m, deploy.InferenceForm) and m.base_class in (TransformerBlock,
                                                                            NaLaBlock):
                    m.__class__ = m.base_class


class TorchvisionMmcvOps:
    """Stands in for mmcv's compiled extension in :mod:`mmcv.ops.nms` and
    :mod:`mmcv.ops.roi_align` (``--mmcv-ops torchvision``): ``nms`` and the average-pooled
    ``roi_align_forward`` / ``roi_align_backward`` run torchvision's kernels, every other name is
    the extension's. For timing detectors on a GPU with an mmcv built without its CUDA ops (as
    ``pip install mmcv`` builds it where no CUDA toolkit is found). Both libraries compute the
    same things: IoU without the +1 offset, RoIAlign on ``(batch index, x1, y1, x2, y2)`` boxes
    with the same sampling and ``aligned`` half-pixel shift."""

    def __init__(self, ext):
        self._ext = ext

    def __getattr__(self, name):
        return getattr(self._ext, name)

    @staticmethod
    def nms(bboxes, scores, iou_threshold, offset=0):
        import torchvision
        if offset != 0:
            raise NotImplementedError('--mmcv-ops torchvision: torchvision has no NMS with the '
                                      f'+1 box offset (offset={offset}); use mmcv\'s own ops')
        return torchvision.ops.nms(bboxes, scores, float(iou_threshold))

    @staticmethod
    def _check_avg(pool_mode):
        if pool_mode != 1:
            raise NotImplementedError('--mmcv-ops torchvision: torchvision\'s RoIAlign averages; '
                                      'max pooling (pool_mode 0) needs mmcv\'s own ops')

    @classmethod
    def roi_align_forward(cls, input, rois, output, argmax_y, argmax_x, aligned_height,
                          aligned_width, spatial_scale, sampling_ratio, pool_mode, aligned):
        import torchvision
        cls._check_avg(pool_mode)
        output.copy_(torchvision.ops.roi_align(input, rois, (aligned_height, aligned_width),
                                               spatial_scale, sampling_ratio, aligned))

    @classmethod
    def roi_align_backward(cls, grad_output, rois, argmax_y, argmax_x, grad_input,
                           aligned_height, aligned_width, spatial_scale, sampling_ratio,
                           pool_mode, aligned):
        import torchvision  # noqa: F401  (registers torch.ops.torchvision)
        cls._check_avg(pool_mode)
        n, c, h, w = grad_input.shape
        grad_input.copy_(torch.ops.torchvision._roi_align_backward(
            grad_output, rois, spatial_scale, aligned_height, aligned_width, n, c, h, w,
            sampling_ratio, aligned))


def route_mmcv_ops_to_torchvision():
    """Make mmcv's NMS and RoIAlign run torchvision's kernels (:class:`TorchvisionMmcvOps`);
    returns a function that restores mmcv's own."""
    import importlib
    # the modules (``mmcv.ops.nms`` as an attribute is the function of that name)
    nms_mod, roi_mod = (importlib.import_module(f'mmcv.ops.{m}') for m in ('nms', 'roi_align'))
    saved = [(m, m.ext_module) for m in (nms_mod, roi_mod)]
    for m, ext in saved:
        m.ext_module = TorchvisionMmcvOps(ext)

    def restore():
        for m, ext in saved:
            m.ext_module = ext
    return restore


# ------------------------------------------------------------------------------------------------
# building targets
# ------------------------------------------------------------------------------------------------
def parse_size(s):
    """``'S'`` -> (S, S), ``'HxW'`` -> (H, W); anything else is an error that shows the forms."""
    import re
    m = re.fullmatch(r'\s*(\d+)\s*(?:[xX]\s*(\d+)\s*)?', str(s))
    if m is None or int(m.group(1)) == 0 or (m.group(2) is not None and int(m.group(2)) == 0):
        raise argparse.ArgumentTypeError(f'{s!r} is not a size: give S or HxW with positive '
                                         f'integers, e.g. 224 or 800x1344')
    h = int(m.group(1))
    return h, int(m.group(2)) if m.group(2) is not None else h


def _check_size(s):
    """argparse type of --sizes / --grid: the text, once :func:`parse_size` takes it."""
    parse_size(s)
    return s


def _target_exists(target):
    """A built-in backbone name, a config file, or a stock config ``'mmdet::...py'``."""
    if target in BACKBONES:
        return True
    try:
        return osp.isfile(_config_path(target))
    except Exception:  # the package of a stock config is not installed
        return False


def core_impls(args):
    """The implementations --mode core runs: ``fast`` is the torch core there."""
    return [i for i in args.impls if i != 'fast'] or ['torch']


def check_names(args, names, impls=None):
    """Refuse, before anything is measured, targets that are neither a built-in backbone nor a
    config file, and --compare baselines that name no target or implementation of the run
    (``names``: the targets' names; ``impls``: the implementations it runs, default
    ``--impls``)."""
    unknown = [t for t in args.targets if not _target_exists(t)]
    if unknown:
        raise SystemExit(f'error: unknown target(s) {unknown}: give built-in backbone names '
                         f'(--list), config files or stock configs (mmdet::path/to/config.py)')
    known = set(names) | set(args.impls if impls is None else impls)
    for spec in args.compare or []:
        only, base = _compare_spec(spec)
        bad = [n for n in (only, base) if n is not None and n not in known]
        if bad:
            raise SystemExit(f'error: --compare {spec}: {bad[0]!r} is neither a target nor an '
                             f'implementation of this run ({", ".join(sorted(known))})')


def _compare_spec(spec):
    """``'BASE'`` -> (None, BASE); ``'TARGET:BASE'`` -> (TARGET, BASE); the ``::`` of a stock
    config name (``mmdet::swin/...``) is not a separator."""
    import re
    seps = [m.start() for m in re.finditer(r'(?<!:):(?!:)', spec)]
    if not seps or osp.exists(spec):
        return None, spec
    return spec[:seps[-1]], spec[seps[-1] + 1:]


def _config_path(path):
    """The file of a config: ``path``, or for a stock OpenMMLab config named
    ``'mmdet::swin/...py'`` the one in the config folder shipped inside the installed package."""
    if '::' in path and not osp.exists(path):
        from mmengine.utils import get_installed_path
        package, rel = path.split('::', 1)
        path = osp.join(get_installed_path(package), '.mim', 'configs', rel)
    return path


def _load_cfg(path):
    """A config file, or a stock OpenMMLab config named ``'mmdet::swin/...py'``."""
    from mmengine.config import Config
    return Config.fromfile(_config_path(path))


def _no_pretrained(bb):
    if isinstance(bb, dict):
        if isinstance(bb.get('init_cfg'), dict) and bb['init_cfg'].get('type') == 'Pretrained':
            bb['init_cfg'] = None
        bb.pop('pretrained', None)
    return bb


def build_backbone(target):
    """A backbone from a built-in name or a config file's model.backbone."""
    from mmengine.registry import init_default_scope
    from mmdet.registry import MODELS as DET_MODELS
    init_default_scope('mmdet')
    if target in BACKBONES:
        cfg = dict(BACKBONES[target][0])
        if cfg['type'].startswith('mmdet.'):  # stock mmdet classes, built directly
            import mmdet.models.backbones as mmdet_backbones
            cls = getattr(mmdet_backbones, cfg.pop('type')[len('mmdet.'):])
            return cls(**cfg)
        if cfg['type'] in ('LinAttnPVT', 'LinAttnSwin', 'NaLaFormer') and 'out_indices' not in cfg:
            cfg['out_indices'] = (0, 1, 2, 3)
    else:
        cfg = _no_pretrained(dict(_load_cfg(target).model.backbone))
        cfg.pop('_delete_', None)
    return DET_MODELS.build(cfg)


def build_full_model(target):
    from linattn_mm.apis import build_model
    cfg = _load_cfg(target)
    return build_model(cfg, pretrained_backbone=False).eval(), cfg


# ------------------------------------------------------------------------------------------------
# timing and memory
# ------------------------------------------------------------------------------------------------
def _sync(device):
    if device.type == 'cuda':
        torch.cuda.synchronize(device)


def _first_tensors(out):
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (list, tuple)):
        res = []
        for o in out:
            res += _first_tensors(o)
        return res
    for name in ('pred_score', 'seg_logits', 'pred_instances'):
        if hasattr(out, name):
            return _first_tensors(getattr(out, name))
    if hasattr(out, 'scores'):
        return [out.scores]
    if hasattr(out, 'data') and isinstance(out.data, torch.Tensor):
        return [out.data]
    return []


def max_abs_diff(a, b):
    ta, tb = _first_tensors(a), _first_tensors(b)
    if not ta or len(ta) != len(tb):
        return float('nan')
    d = 0.
    for x, y in zip(ta, tb):
        if x.shape != y.shape:
            return float('nan')
        d = max(d, (x.float() - y.float()).abs().max().item() if x.numel() else 0.)
    return d


def max_abs(a):
    t = _first_tensors(a)
    return max((x.float().abs().max().item() for x in t if x.numel()), default=0.)


def _runner(fn, device, autocast_dtype):
    def run():
        with torch.inference_mode(), torch.autocast(device.type, dtype=autocast_dtype,
                                                    enabled=autocast_dtype is not None):
            return fn()
    return run


def _as_run(fn, device, autocast_dtype):
    """The call a variant times: a training step (``fn.train``) as it is, a forward under
    :func:`_runner`."""
    return fn if getattr(fn, 'train', False) else _runner(fn, device, autocast_dtype)


def _train_autocast(device, autocast_dtype):
    """The autocast of a training step's forward: none (``autocast_dtype`` None), CUDA's on
    ``meta`` tensors, or ``torch.autocast`` of the device."""
    if autocast_dtype is None:
        return no_autocast(device)
    if device.type == 'meta':
        return meta_autocast(autocast_dtype)
    return torch.autocast(device.type, dtype=autocast_dtype)


def _train_runner(fn, device, autocast_dtype, model=None):
    """A training step: ``fn`` runs the forward and returns the loss, which is backpropagated.
    ``model``'s gradients are cleared before the memory run (``run.clear``), so that the previous
    step's gradients are not counted in the base of a CUDA peak."""
    def run():
        with _train_autocast(device, autocast_dtype):
            loss = fn()
        loss.backward()
        return loss.detach()
    run.train = True
    if model is not None:
        run.clear = lambda: model.zero_grad(set_to_none=True)
    return run


def train_step(model, inputs):
    """The loss of one training step of a backbone (``sum(mean(out^2))`` of its outputs), the
    gradients of the previous step cleared first."""
    model.zero_grad(set_to_none=True)
    outs = model(inputs)
    return sum(o.float().square().mean() for o in outs)


def model_train_step(model, inputs, samples):
    """The summed losses of one training step of a whole model on a synthetic batch."""
    model.zero_grad(set_to_none=True)
    losses = model(inputs, [s.clone() for s in samples], mode='loss')
    loss, _ = model.parse_losses(losses)
    return loss


META_MEMORY = 'PeakMemoryCounter on meta (live tensors of the GPU path)'


def peak_memory(run, device):
    """Peak bytes allocated by one forward (or training step) and how they were measured."""
    if hasattr(run, 'clear'):
        run.clear()
    gc.collect()
    if device.type == 'meta':
        with PeakMemoryCounter(include_meta=True) as mem:
            out = run()
        return out, mem.peak_bytes, META_MEMORY
    if device.type == 'cuda':
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        out = run()
        _sync(device)
        return out, torch.cuda.max_memory_allocated(device) - base, 'cuda max_memory_allocated'
    with PeakMemoryCounter() as mem:
        out = run()
    return out, mem.peak_bytes, 'PeakMemoryCounter (live tensor storage)'


#: memory bandwidth (bytes/s) and dense peak rates (FLOP/s per dtype) of the GPUs that
#: ``--roofline`` names, from the vendor's data sheets (SXM parts; no sparsity). float32 matrix
#: products at the FP32 rate (torch's default: no TF32 for them)
_HOPPER_PEAKS = {torch.float32: 67e12, torch.bfloat16: 989e12, torch.float16: 989e12}
ROOFLINES = {'h100-sxm': (3.35e12, _HOPPER_PEAKS), 'h200': (4.8e12, _HOPPER_PEAKS)}


def count_operations(run, roofline=None, model=None):
    """The ATen operations (views excluded) of one more call of ``run``, the bytes they move and
    their FLOPs (:class:`~linattn_mm.utils.TrafficCounter`), and with ``roofline`` (a key of
    :data:`ROOFLINES`) the roofline bound of that GPU's time in seconds (else None). With
    ``model``, the same call counted by its module classes too (``by_module``:
    :class:`~linattn_mm.utils.OperationsByModule`)."""
    with TrafficCounter() if model is None else OperationsByModule(model) as ops:
        out = run()
    del out
    bound = None if roofline is None else ops.roofline_seconds(*ROOFLINES[roofline])
    counts = dict(total=ops.total, bytes=ops.bytes_moved, flops=ops.flops, roofline_s=bound)
    if model is not None:
        counts['by_module'] = dict(ops.by_module)
    return counts


def _emit_by_module(bar, result, ops, most):
    """Print the ``most`` entries of a step's counts by module (``ops['by_module']`` of
    :func:`count_operations`) with the most operations under the result's row, and keep them in
    the result (``operations_by_module``)."""
    if ops is None or 'by_module' not in ops:
        return
    top = sorted(ops['by_module'].items(), key=lambda kv: (-kv[1][0], kv[0]))[:most]
    result['operations_by_module'] = [dict(module=m, phase=p, operations=n, bytes=b)
                                      for (m, p), (n, b) in top]
    for (mod, phase), (n, nbytes) in top:
        emit(bar, f'    {mod:34s} {phase:8s} {n:6d} ops ({n / max(ops["total"], 1):5.1%})  '
                  f'{nbytes / 1e9:8.2f} GB')


def measure_interleaved(variants, device, warmup, repeats, autocast_dtype, count_ops=False,
                        roofline=None, models=None, note=None):
    """Time several variants of one forward in rounds (A, B, C, A, B, C, ...), so that a change of
    the background load on a shared machine hits all of them alike.

    Args:
        variants (list[tuple[str, callable, callable]]): (name, activate(), forward()).
        count_ops (bool): also count the operations of one more call of each (and the bytes
            they move, their FLOPs and with ``roofline`` its bound: :func:`count_operations`).
        models (dict, optional): name -> the module whose operations that variant's counted
            call also counts by module class (``count_ops`` for those variants).
        note (callable, optional): called with a line after each variant's warm-up, the timed
            rounds and each variant's memory run (``--log-progress``).

    Returns:
        dict: name -> (median s, times, output of the memory run, peak bytes, method, number
        counts of :func:`count_operations` or None).
    """
    runs = [(name, act, _as_run(fn, device, autocast_dtype)) for name, act, fn in variants]
    note = note or (lambda line: None)
    for name, act, run in runs:
        t0 = time.perf_counter()
        act()
        for _ in range(warmup):
            run()
        _sync(device)
        note(f'warm-up of {name}: {time.perf_counter() - t0:.1f} s')
    times = {name: [] for name, _, _ in runs}
    for _ in range(repeats):
        for name, act, run in runs:
            act()
            t0 = time.perf_counter()
            out = run()
            _sync(device)
            times[name].append(time.perf_counter() - t0)
            del out
    note(f'{repeats} timed rounds')
    res = {}
    for name, act, run in runs:
        act()
        out, peak, how = peak_memory(run, device)
        model = (models or {}).get(name)
        ops = count_operations(run, roofline, model) if count_ops or model is not None else None
        res[name] = (statistics.median(times[name]), times[name], out, peak, how, ops)
        note(f'memory run of {name}')
    return res


# ------------------------------------------------------------------------------------------------
# main
# ------------------------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('targets', nargs='*', help='backbone names (--list) or config files; '
                   'unused in --mode attention')
    p.add_argument('--mode', choices=['backbone', 'model', 'attention', 'core', 'train'],
                   default='backbone')
    p.add_argument('--part', choices=['backbone', 'model'], default='backbone',
                   help='--mode train: a config target trains its backbone or its whole model')
    p.add_argument('--list', action='store_true', help='list the built-in backbones and exit')
    p.add_argument('--device', default='cpu', help='cpu | cuda | cuda:N')
    p.add_argument('--dtype', choices=['fp32', 'bf16', 'fp16'], default='fp32',
                   help='fp32, or bf16 / fp16 autocast')
    p.add_argument('--batch', type=int, default=1)
    p.add_argument('--sizes', nargs='+', default=None, type=_check_size,
                   help="input sizes 'S' or 'HxW' (default 224; attention mode: --grid)")
    p.add_argument('--warmup', type=int, default=2)
    p.add_argument('--repeats', type=int, default=5, help='timed forwards; median reported')
    p.add_argument('--threads', type=int, default=None, help='torch CPU threads')
    p.add_argument('--impls', nargs='+', choices=POLA_IMPLS + TRITON_VARIANTS,
                   default=['fast'], help='Pola mixer implementations to run for every target '
                   '(--mode core: cores; triton-tf32x3 is the Triton core with its products on '
                   'the tensor cores, triton-w4b64 with its gradient passes launched as up to '
                   '0.6.11 at head dims up to 32)')
    p.add_argument('--compare', nargs='+', default=None,
                   help="baselines for time ratios: 'BASE' (a target or an implementation name, "
                   "for every other result) or 'TARGET:BASE' (one pair)")
    p.add_argument('--ffn', choices=['auto', 'plain'], default='auto',
                   help="transformer blocks' FFN half: 'auto' (fused for the plugin's fast "
                   "implementations, plain for reference/official) or 'plain' for all")
    p.add_argument('--forward', choices=['tensor', 'predict'], default='tensor',
                   help="--mode model: forward mode (predict needs data samples; they are made)")
    p.add_argument('--grid', nargs='+', default=['128x128'], type=_check_size,
                   help='--mode attention: token grids HxW (N = H*W)')
    p.add_argument('--heads', type=int, default=3)
    p.add_argument('--head-dims', type=int, default=32)
    p.add_argument('--layout', choices=['qkvg', 'qg_kv'], default='qkvg')
    p.add_argument('--attn', choices=['pola', 'nala'], default='pola',
                   help='--mode attention and --mode core: the mixer or core (Pola or NaLa)')
    p.add_argument('--la-sr-ratio', type=int, default=1)
    p.add_argument('--seed', type=int, default=0)
    p.add_argument('--heap-malloc', action='store_true',
                   help='CPU: serve large tensors from the heap instead of fresh mmaps (glibc; '
                   'linattn_mm.utils.use_heap_allocator)')
    p.add_argument('--peak-bw', type=float, help='--mode core: device peak bandwidth, GB/s')
    p.add_argument('--backward', action='store_true',
                   help='--mode core: time the forward and the backward of the core')
    p.add_argument('--profile', type=int, metavar='CALLS',
                   help='after the measurements, profile CALLS calls (forwards, training '
                   'steps, core calls) of each target and implementation (torch.profiler; CUDA '
                   'kernels on a GPU) and print the operations and kernels that took the most '
                   'time, after a line with each call\'s wall time under the profiler (on a '
                   'GPU also the time its kernels kept the device busy: well under the wall '
                   'time, the host paced the calls)')
    p.add_argument('--log-progress', action='store_true',
                   help='write each build, warm-up and round of measurements to stderr as a '
                   'line with the seconds since the start (logs of runs under a time limit: '
                   'one stopped shows how far it came)')
    p.add_argument('--count-ops', action='store_true',
                   help='also count the ATen operations (views excluded) of one more step of '
                        'each target; with --device meta always, next to the peak of live '
                        'tensors (shapes only: the paths a model takes off CPU, with no GPU); '
                        'also the GB the operations move and their TFLOP')
    p.add_argument('--roofline', choices=sorted(ROOFLINES), default=None,
                   help='with the operations counted: also the roofline bound of the step on '
                        'that GPU (every operation at least its bytes over the bandwidth and its '
                        'FLOPs over the peak rate)')
    p.add_argument('--ops-by-module', type=int, default=None, metavar='N',
                   help='--mode train: count the operations of each target (as --count-ops) '
                        'also by module class (forward: the innermost module running; '
                        'backward: the module whose forward made the autograd node), the N with '
                        'the most operations printed, with the bytes they move')
    p.add_argument('--compile', nargs='?', const='inductor', default=None, metavar='BACKEND',
                   help='--mode train, backbones: torch.compile each backbone (backend inductor, '
                        'or the one named) and time its compiled steps; the warm-up steps '
                        'compile')
    p.add_argument('--mmcv-ops', choices=['mmcv', 'torchvision'], default='mmcv',
                   help="detectors' NMS and RoIAlign: mmcv's compiled ops, or torchvision's "
                        '(for a GPU where mmcv was built without its CUDA ops)')
    p.add_argument('--fused-launch', metavar='WARPS:ELEMENTS', type=_fused_launch_arg,
                   help='launch the fused forms\' kernels (--impls fused) with WARPS warps per '
                   'program and the fused cores\' tiles with ELEMENTS elements instead of '
                   '4:2048 (ops.dispatch.fused_launch): to compare launches on a GPU')
    p.add_argument('--json', help='write all results to this JSON file')
    p.add_argument('--plot', help='write a log-log plot of time and peak memory vs pixels')
    return p.parse_args(argv)


def _fused_launch_arg(text):
    """``--fused-launch WARPS:ELEMENTS`` as ``(warps, elements)``, checked as
    :func:`~linattn_mm.ops.dispatch.fused_launch` checks them."""
    from linattn_mm.ops.dispatch import fused_launch
    try:
        warps, elements = (int(v) for v in text.split(':'))
        with fused_launch(warps, elements):
            pass
    except ValueError as e:
        raise argparse.ArgumentTypeError(
            f'{text!r}: WARPS:ELEMENTS, warps 1, 2, 4, 8 or 16 and elements a power of two '
            f'>= 256 ({e})') from None
    return warps, elements


def _randomise_pola(model, seed):
    """Non-trivial power / scale / PE / dwc (they start at zero) so the impls are really compared."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in pola_modules(model):
            m.power.copy_(torch.randn(m.power.shape, generator=g))
            if m.temperature:
                m.scale.copy_(torch.rand(m.scale.shape, generator=g) * 2 - 1)
            if m.use_pos_enc:
                m.positional_encoding.copy_(
                    torch.randn(m.positional_encoding.shape, generator=g) * 0.3)


@contextlib.contextmanager
def fused_attention_on_meta():
    """``F.scaled_dot_product_attention`` of ``meta`` tensors as the fused kernel a GPU runs
    (torch knows its shapes on meta, and its backward), where torch would run the decomposition on
    meta (the (N, N) attention matrix and its softmax: operations and memory a GPU does not
    spend): the memory-efficient kernel (``aten._scaled_dot_product_efficient_attention``) in
    float32 or with a mask; under :func:`~linattn_mm.utils.meta_autocast` the inputs cast to its
    dtype, as autocast does, and without a mask the flash kernel
    (``aten._scaled_dot_product_flash_attention``, head dims of multiples of 8 up to 256). Other
    devices as before."""
    sdpa = F.scaled_dot_product_attention

    def call(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
             enable_gqa=False):
        if query.device.type != 'meta' or enable_gqa:
            return sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                        is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        if autocast_on(query.device):
            query, key, value, attn_mask = autocast_args(query, key, value, attn_mask)
            d = query.shape[-1]
            if (attn_mask is None and d % 8 == 0 and d <= 256 and key.shape[-1] == d
                    and value.shape[-1] == d):
                return torch.ops.aten._scaled_dot_product_flash_attention(
                    query, key, value, dropout_p, is_causal, scale=scale)[0]
        if attn_mask is not None:  # as torch's sdpa does for this kernel: a mask whose strides
            # are not multiples of 8 elements is copied into a padded one (``preprocess_mask``)
            if attn_mask.stride(-1) != 1 or any(st % 8 for st in attn_mask.stride()[:-1]):
                n = attn_mask.shape[-1]
                attn_mask = F.pad(attn_mask, (0, 8 - n % 8))[..., :n]
            attn_mask = attn_mask.expand(*query.shape[:-1], key.shape[-2])
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, attn_mask, grad, dropout_p, is_causal, scale=scale)[0]
    F.scaled_dot_product_attention = call
    try:
        yield
    finally:
        F.scaled_dot_product_attention = sdpa


def main(argv=None):
    args = parse_args(argv)
    with contextlib.ExitStack() as stack:
        if torch.device(args.device).type == 'meta':
            stack.enter_context(fused_attention_on_meta())
        if args.mmcv_ops == 'torchvision':  # mmcv's own ops again when the run ends
            stack.callback(route_mmcv_ops_to_torchvision())
        if args.fused_launch:
            from linattn_mm.ops.dispatch import fused_launch
            stack.enter_context(fused_launch(*args.fused_launch))
        return _main(args)


def _progress_note(args):
    """``--log-progress``: a function that writes ``# progress T s: LINE`` to stderr, T the
    seconds since it was made; else one that does nothing."""
    if not args.log_progress:
        return lambda line: None
    start = time.perf_counter()
    return lambda line: print(f'# progress {time.perf_counter() - start:.1f} s: {line}',
                              file=sys.stderr, flush=True)


def _main(args):
    note = _progress_note(args)
    variants = [impl for impl in args.impls if impl in TRITON_VARIANTS]
    if variants and args.mode != 'core':
        raise SystemExit(f'--impls {variants[0]} (the Triton core run another way) is an '
                         f'implementation of --mode core')
    if args.profile is not None and args.profile < 1:
        raise SystemExit(f'--profile CALLS: at least one call, got {args.profile}')
    if args.profile and torch.device(args.device).type == 'meta':
        raise SystemExit('--profile times operations and kernels: not on --device meta, which '
                         'computes nothing')
    if args.list:
        for k, (_, desc) in BACKBONES.items():
            print(f'{k:22s} {desc}')
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    heap = use_heap_allocator() if args.heap_malloc else None
    device = torch.device(args.device)
    if device.type == 'meta' and args.mode != 'train':
        raise SystemExit('--device meta counts the operations of training steps only '
                         '(--mode train)')
    if args.compile and (args.mode != 'train' or args.part == 'model' or device.type == 'meta'
                         or args.warmup < 1 or args.count_ops):
        raise SystemExit('--compile times compiled training steps of backbones (--mode train, '
                         'not --part model, not on meta, without --count-ops: a compiled step '
                         'runs eager under the counter) and needs --warmup 1 or more: the first '
                         'step compiles')
    if args.roofline and not (args.count_ops or args.device == 'meta'):
        raise SystemExit('--roofline bounds the counted operations: give --count-ops, or '
                         '--device meta (which always counts them)')
    if args.ops_by_module is not None and (args.mode != 'train' or args.compile
                                           or args.ops_by_module < 1):
        raise SystemExit('--ops-by-module N (N >= 1) counts training steps by module: '
                         '--mode train, not --compile')
    if args.count_ops and args.mode == 'core':
        raise SystemExit('--count-ops counts the operations of a model or layer step; '
                         '--mode core does not take it')
    ac = {'fp32': None, 'bf16': torch.bfloat16, 'fp16': torch.float16}[args.dtype]
    # the CPU inference forms (--impls fast) run float32 / float64: not under autocast
    cpu_autocast = ac is not None and device.type == 'cpu' and args.mode in ('backbone', 'model')
    torch.manual_seed(args.seed)
    mem_note = {'cuda': 'cuda max_memory_allocated', 'meta': META_MEMORY}.get(device.type,
                                                                           'PeakMemoryCounter')
    print(f'# torch {torch.__version__}, device {device}, threads {torch.get_num_threads()}, '
          f'dtype {args.dtype}, batch {args.batch}, warmup {args.warmup}, repeats {args.repeats}'
          f' (median), peak memory: {mem_note}'
          + ('' if heap is None else f', heap allocator: {"on" if heap else "not glibc, off"}'))

    if args.mode == 'core':
        check_names(args, [], core_impls(args))
        return run_core(args, device, note)
    # --- targets: (name, build() -> (module, make_input(size) -> callable)) ---
    jobs = []
    if args.mode == 'attention':
        sizes = [parse_size(s) for s in args.grid]
        C = args.heads * args.head_dims
        name = f'pola-attn-{args.layout}-h{args.heads}-d{args.head_dims}' if \
            args.attn == 'pola' else f'nala-attn-h{args.heads}-d{args.head_dims}'

        def build_attn(hw0=sizes[0]):
            if args.attn == 'nala':
                return NormAwareLinearAttention(C, args.heads)
            m = PolaLinearAttention(C, args.heads, qkv_layout=args.layout,
                                    la_sr_ratio=args.la_sr_ratio, pretrain_hw=hw0)
            return m

        def call_attn(m, hw):
            x = torch.randn(args.batch, hw[0] * hw[1], C, device=device)
            return lambda: m(x, hw)
        jobs.append((name, build_attn, call_attn))
    else:
        sizes = [parse_size(s) for s in (args.sizes or ['224'])]
        if not args.targets:
            raise SystemExit('give at least one target (a backbone name or a config file)')
        for t in args.targets:
            train_model = args.mode == 'train' and args.part == 'model' and t not in BACKBONES
            if args.mode == 'train' and not train_model:
                def call_train_bb(m, hw):
                    x = torch.randn(args.batch, 3, *hw, device=device)
                    # compiled: the forward (and with it the backward) of the module, traced at
                    # the first step; the parameters and their gradients are the module's
                    mc = torch.compile(m, backend=args.compile) if args.compile else m
                    return _train_runner(lambda: train_step(mc, x), device, ac, m)
                jobs.append((t, lambda t=t: build_backbone(t), call_train_bb))
            elif train_model:
                def build_train_m(t=t):
                    from linattn_mm.apis import build_model
                    cfg = _load_cfg(t)
                    model = build_model(cfg, pretrained_backbone=False)
                    model.linattn_bench = cfg
                    return model

                def call_train_m(model, hw):
                    from linattn_mm.utils.synthetic import training_batch
                    inputs, samples = training_batch(model.linattn_bench, hw, args.batch,
                                                     args.seed)
                    inputs = inputs.to(device)
                    samples = [s.to(device) for s in samples]
                    return _train_runner(lambda: model_train_step(model, inputs, samples),
                                         device, ac, model)
                jobs.append((t, build_train_m, call_train_m))
            elif args.mode == 'backbone':
                def call_bb(m, hw):
                    x = torch.randn(args.batch, 3, *hw, device=device)
                    return lambda: m(x)
                jobs.append((t, lambda t=t: build_backbone(t), call_bb))
            else:
                def build_m(t=t):
                    model, cfg = build_full_model(t)
                    model.linattn_bench = cfg
                    return model

                def call_m(model, hw):
                    inputs, samples = dummy_inputs(model.linattn_bench, hw)
                    inputs = inputs.to(device).expand(args.batch, -1, -1, -1).contiguous()
                    inputs.normal_()
                    if samples is not None:
                        samples = [samples[0].clone() for _ in range(args.batch)]
                    if args.forward == 'predict':
                        # predict() writes into the data samples: fresh copies per call
                        return lambda: model(
                            inputs, None if samples is None else [s.clone() for s in samples],
                            mode='predict')
                    return lambda: model(inputs, samples, mode='tensor')
                jobs.append((t, build_m, call_m))

    results = []
    check_names(args, [job[0] for job in jobs])
    bar = progress_bar(len(jobs) * len(sizes), 'benchmark', unit='run', dynamic_ncols=True)
    # --mode train: every target is built first and their steps run in interleaved rounds (A, B,
    # C, A, B, C, ...), so that a change of the machine's load hits them alike; the other modes
    # measure one target after the other (their implementations interleaved)
    groups = [jobs] if args.mode == 'train' else [[job] for job in jobs]
    for group in groups:
        built = []
        for name, build, call in group:
            if bar is not None:
                bar.set_postfix_str(f'building {name}')
            t0 = time.perf_counter()
            model = build().to(device)
            note(f'built {name} in {time.perf_counter() - t0:.1f} s')
            # (some mmdet backbones' train() returns None: no chaining)
            model.train() if args.mode == 'train' else model.eval()
            _randomise_pola(model, args.seed)
            has_mixers = bool(pola_modules(model) or nala_modules(model))
            impls = args.impls if has_mixers else ['-']
            if cpu_autocast and 'fast' in impls:
                impls = [i for i in impls if i != 'fast']
                emit(bar, f'{name}: --impls fast skipped under --dtype {args.dtype}: the CPU '
                     f'inference forms run float32 and float64 only (--impls torch: the plain '
                     f'forms under autocast)')
                if not impls:
                    continue
            built.append((name, model, call, impls, has_mixers,
                          sum(p.numel() for p in model.parameters())))
        for hw in sizes:
            if bar is not None:
                bar.set_postfix_str(' '.join(b[0] for b in built) + f' {hw[0]}x{hw[1]}')
            variants, labels = [], {}
            for name, model, call, impls, _, _ in built:
                torch.manual_seed(args.seed + 1)
                fn_base = call(model, hw)
                for impl in impls:
                    key = f'{name} | {impl}'
                    labels[key] = (name, impl)
                    # a target without Pola / NaLa mixers: its inference forms (the plain ones
                    # under autocast on CPU)
                    plain = 'torch' if cpu_autocast else 'fast'
                    variants.append((key, (lambda impl=impl, model=model: set_impl(
                        model, plain if impl == '-' else impl, args.ffn,
                        train=args.mode == 'train')), fn_base))
            # --ops-by-module: the counted step of each variant, by the modules of its model
            models = None if args.ops_by_module is None else {
                f'{b[0]} | {impl}': b[1] for b in built for impl in b[3]}
            try:
                meas = measure_interleaved(variants, device, args.warmup, args.repeats, ac,
                                           args.count_ops or device.type == 'meta',
                                           args.roofline, models, note)
            except (RuntimeError, MemoryError) as e:  # e.g. out of memory
                emit(bar, f'{" ".join(b[0] for b in built)} {hw[0]}x{hw[1]}: FAILED '
                     f'{type(e).__name__}: {str(e)[:200]}')
                if bar is not None:
                    bar.update(len(built))
                continue
            for name, model, call, impls, _, nparams in built:
                first_out = meas[f'{name} | {impls[0]}'][2]
                for impl in impls:
                    med, times, out, peak, how, ops = meas[f'{name} | {impl}']
                    if args.compile and device.type != 'cuda':
                        # the counter is a dispatch mode, under which dynamo runs the step eager
                        peak, how = float('nan'), 'not measured (compiled, off CUDA)'
                    diff = None if impl == impls[0] or device.type == 'meta' else max_abs_diff(
                        first_out, out)
                    r = dict(target=name, impl=impl, size=list(hw), pixels=hw[0] * hw[1],
                             batch=args.batch, latency_ms=med * 1e3,
                             times_ms=[t * 1e3 for t in times], img_per_s=args.batch / med,
                             peak_mem_mb=peak / 2**20, peak_mem_method=how, params=nparams,
                             max_abs_diff_vs_first_impl=diff,
                             max_abs_output=None if device.type == 'meta' else max_abs(out),
                             operations=None if ops is None else ops['total'],
                             bytes_moved=None if ops is None else ops['bytes'],
                             flops=None if ops is None else ops['flops'])
                    if ops is not None and ops['roofline_s'] is not None:
                        r['roofline_ms'] = ops['roofline_s'] * 1e3
                        r['roofline_device'] = args.roofline
                    if device.type == 'meta':  # nothing computed: no time
                        r.update(latency_ms=None, times_ms=[], img_per_s=None)
                    results.append(r)
                    extra = '' if diff is None else (f'  max|diff| vs {impls[0]} = {diff:.3g} '
                                                     f'(max|out| {r["max_abs_output"]:.3g})')
                    traffic = ''
                    if ops is not None:
                        traffic = (f'  {ops["bytes"] / 1e9:7.1f} GB moved  '
                                   f'{ops["flops"] / 1e12:6.2f} TFLOP')
                        if 'roofline_ms' in r:
                            traffic += f'  roofline {args.roofline} {r["roofline_ms"]:.1f} ms'
                        extra = f'  {ops["total"]:6d} ops' + extra + traffic
                    if device.type == 'meta':  # no time: operations and memory
                        emit(bar, f'{name:28s} {impl:9s} {hw[0]:5d}x{hw[1]:<5d} '
                             f'{ops["total"]:6d} ops  peak {peak / 2**20:9.1f} MB{traffic}')
                        _emit_by_module(bar, r, ops, args.ops_by_module)
                        del out
                        continue
                    emit(bar, f'{name:28s} {impl:9s} {hw[0]:5d}x{hw[1]:<5d} {med * 1e3:10.1f} ms '
                         f'(min {min(times) * 1e3:.1f}) {args.batch / med:9.2f} img/s  '
                         f'peak {peak / 2**20:9.1f} MB{extra}')
                    _emit_by_module(bar, r, ops, args.ops_by_module)
                    del out
                del first_out
            if args.profile:  # each variant's calls under torch.profiler, after the timings
                for key, act, fn in variants:
                    act()
                    run = _as_run(fn, device, ac)
                    emit(bar, f'# profile of {key}, {args.profile} calls, {hw[0]}x{hw[1]}:\n'
                              + profile_table(run, device, args.profile))
            del meas, variants
            gc.collect()
            if bar is not None:
                bar.update(len(built))
        for name, model, call, impls, has_mixers, _ in built:
            if has_mixers:
                set_impl(model, 'fast', train=args.mode == 'train')
        del built
        gc.collect()
        if device.type == 'cuda':
            torch.cuda.empty_cache()
    if bar is not None:
        bar.close()

    for spec in args.compare or []:
        only, base_name = _compare_spec(spec)
        if device.type == 'meta':
            print(f'\n# operations per step and peak memory (live tensors of the GPU path): '
                  f'this / {base_name}')
        else:
            print(f'\n# time ratios: {base_name} / this (> 1 means faster than {base_name}); peak '
                  f'memory ratios: this / {base_name} (< 1 means leaner)')
        for r in results:
            if only is not None and r['target'] != only:
                continue
            base = [b for b in results if b['size'] == r['size'] and b is not r and (
                (b['target'] == base_name and b['impl'] in (r['impl'], '-', 'fast'))
                or (b['impl'] == base_name and b['target'] == r['target']))]
            if base and r['target'] != base_name and r['impl'] != base_name:
                ops = ''
                if r['operations'] is not None:
                    ops_ratio = r['operations'] / max(base[0]['operations'], 1)
                    r['operations_ratio_vs_' + base_name] = ops_ratio
                    ops = f'; operations {ops_ratio:.2f}x ({r["operations"]} / ' \
                          f'{base[0]["operations"]})'
                    moved = r['bytes_moved'] / max(base[0]['bytes_moved'], 1)
                    r['bytes_ratio_vs_' + base_name] = moved
                    ops += f'; bytes {moved:.2f}x'
                    if 'roofline_ms' in r and 'roofline_ms' in base[0]:
                        bound = r['roofline_ms'] / base[0]['roofline_ms']
                        r['roofline_ratio_vs_' + base_name] = bound
                        ops += f'; roofline {bound:.2f}x'
                mem = r['peak_mem_mb'] / max(base[0]['peak_mem_mb'], 1e-9)
                if device.type == 'meta':
                    r['memory_ratio_vs_' + base_name] = mem
                    print(f'{r["target"]:28s} {r["impl"]:9s} {r["size"][0]}x{r["size"][1]}: '
                          f'{ops[2:]}; memory {mem:.2f}x ({r["peak_mem_mb"]:.0f} / '
                          f'{base[0]["peak_mem_mb"]:.0f} MB)')
                    continue
                ratio = base[0]['latency_ms'] / r['latency_ms']
                r['speedup_vs_' + base_name] = ratio
                r['memory_ratio_vs_' + base_name] = mem
                print(f'{r["target"]:28s} {r["impl"]:9s} {r["size"][0]}x{r["size"][1]}: '
                      f'{ratio:.2f}x  ({base[0]["latency_ms"]:.1f} / {r["latency_ms"]:.1f} ms); '
                      f'memory {mem:.2f}x ({r["peak_mem_mb"]:.0f} / '
                      f'{base[0]["peak_mem_mb"]:.0f} MB){ops}')

    # scaling summary (not on meta: no times)
    by = {}
    for r in results if device.type != 'meta' else []:
        by.setdefault((r['target'], r['impl']), []).append(r)
    if any(len(v) > 1 for v in by.values()):
        print('\n# scaling: time ratio between consecutive sizes, and log-log slope (time ~ px^s)')
        for (t, i), rs in by.items():
            rs = sorted(rs, key=lambda r: r['pixels'])
            if len(rs) < 2:
                continue
            steps = ', '.join(
                f'{b["size"][0]}x{b["size"][1]}/{a["size"][0]}x{a["size"][1]}: '
                f'{b["latency_ms"] / a["latency_ms"]:.2f}' for a, b in zip(rs, rs[1:]))
            print(f'{t:28s} {i:9s} {steps}; slope {_slope(rs, "latency_ms"):.2f} '
                  f'(memory {_slope(rs, "peak_mem_mb"):.2f})')

    if args.json:
        with open(args.json, 'w') as f:
            json.dump(dict(args=vars(args), torch=torch.__version__, device=str(device),
                           threads=torch.get_num_threads(), results=results), f, indent=1)
        print(f'wrote {args.json}')
    if args.plot:
        plot(results, args.plot, f'{args.mode}, {device}, {args.dtype}, batch {args.batch}')
        print(f'wrote {args.plot}')
    return results


CORE_IMPLS = ('triton', 'triton-tf32x3', 'triton-w4b64', 'fused', 'torch', 'reference')

#: the Triton cores run another way (``--mode core`` only): ``triton-tf32x3`` with their products
#: on the tensor cores (``ops.dispatch.triton_dot_precision``), ``triton-w4b64`` with the gradient
#: passes launched as up to version 0.6.11 at head dims up to 32, 4 warps and blocks of 64 tokens
#: (``ops.dispatch.triton_core_launch``), to compare with the default launch
TRITON_VARIANTS = ('triton-tf32x3', 'triton-w4b64')

#: ``--mode core`` implementation -> the core name of :mod:`linattn_mm.ops`
CORE_NAMES = {'triton': 'triton', 'triton-tf32x3': 'triton', 'triton-w4b64': 'triton',
              'fused': 'fused', 'torch': 'fast', 'reference': 'reference'}


def _in_triton_variant(impl, fn):
    """``fn`` run with the Triton settings of ``impl`` (:data:`TRITON_VARIANTS`), forward and
    backward."""
    if impl not in TRITON_VARIANTS:
        return fn
    from linattn_mm.ops.dispatch import triton_core_launch, triton_dot_precision

    def setting():
        if impl == 'triton-tf32x3':
            return triton_dot_precision('tf32x3')
        return triton_core_launch(backward=(4, 64))

    def run():
        with setting():
            return fn()
    run.train = getattr(fn, 'train', False)
    return run


def _core_name(impl):
    if impl not in CORE_NAMES:
        raise SystemExit(f'--mode core: unknown implementation {impl!r}; choose from {CORE_IMPLS}')
    return CORE_NAMES[impl]


def nala_core_function(impl, q, k, v, sin, cos, eps=1e-6):
    """One call of the NaLa attention core (official kernel, lam = 3, 2-D RoPE) for ``impl``."""
    from linattn_mm.ops.nala import nala_attention
    core = _core_name(impl)
    return lambda: nala_attention(q, k, v, 3., eps, sin, cos, core=core)


def core_function(impl, q, k, v, p, inv_s, pe, eps=1e-6):
    """One call of the Pola attention core as the module makes it for ``impl`` (torch cores in
    float32, the Triton core reading the inputs in their dtype)."""
    from linattn_mm.ops.pola import polarity_attention
    core = _core_name(impl)
    return lambda: polarity_attention(q, k, v, p, eps, 1 / inv_s, pe, core=core)


def device_peak_bw(device, given=None):
    """Peak memory bandwidth in GB/s: ``given``, else known for the CUDA device, else None."""
    if given:
        return given
    if device.type != 'cuda':
        return None
    name = torch.cuda.get_device_name(device)
    return next((bw for key, bw in PEAK_BW if key in name), None)


def _core_step(fn, leaves, seed):
    """A training step of a core call ``fn``: its forward and its backward with a fixed random
    output gradient (the inputs' gradients cleared first). Returns the output."""
    grad = []

    def run():
        for t in leaves:
            t.grad = None
        with no_autocast(leaves[0].device):
            out = fn()
        if not grad:
            g = torch.Generator().manual_seed(seed + 1)
            grad.append(torch.randn(out.shape, generator=g).to(out.device, out.dtype))
        out.backward(grad[0])
        return out.detach()
    run.train = True
    return run


def profile_table(fn, device, calls, rows=12):
    """``calls`` calls of ``fn`` under ``torch.profiler`` (with CUDA activity on a GPU): a line of
    what each call took (:func:`profile_summary`), then the ``rows`` operations and kernels that
    took the most time of their own, as torch's table."""
    from torch.profiler import ProfilerActivity, profile
    cuda = device.type == 'cuda'
    fn()  # not the first call: compilations and caches stay out of the table
    _sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    walls = []
    with profile(activities=activities) as prof:
        for _ in range(calls):
            t0 = time.perf_counter()
            fn()
            _sync(device)
            walls.append(time.perf_counter() - t0)
    averages = prof.key_averages()
    return profile_summary(averages, walls) + '\n' + averages.table(
        sort_by='self_device_time_total' if cuda else 'self_cpu_time_total', row_limit=rows,
        max_name_column_width=70)


def profile_summary(averages, walls):
    """One line on profiled calls: the wall time of each (each call waits for the device at its
    end), and where the profile has device activities (CUDA kernels, copies and fills) their
    time per call, its share of the wall time, and their number per call. A GPU busy for much
    less than the wall time waited for the host (its launches and the Python around them); a
    share near 100 % puts the time in the kernels. The walls are taken under the profiler, whose
    own work per operation slows the host: the share is lower than without it, most for calls of
    many small kernels (compare the wall with the unprofiled times above it). Kernels that
    overlap on several streams count each: the share can pass 100 %.

    Args:
        averages: ``prof.key_averages()`` of a ``torch.profiler`` run (rows with
            ``device_type``, ``count``, ``self_device_time_total`` in microseconds and
            ``is_user_annotation``).
        walls (list[float]): seconds of each call, at least one.
    """
    ms = [w * 1e3 for w in walls]
    line = (f'# {len(ms)} call{"s" if len(ms) != 1 else ""} under the profiler: wall median '
            f'{statistics.median(ms):.1f} ms per call (each: {", ".join(f"{w:.1f}" for w in ms)} '
            f'ms)')
    device = [e for e in averages if e.device_type != torch.autograd.DeviceType.CPU
              and not getattr(e, 'is_user_annotation', False)]
    if device:
        busy = sum(e.self_device_time_total for e in device) / 1e3 / len(ms)
        launches = sum(e.count for e in device) / len(ms)
        line += (f'; device busy {busy:.1f} ms per call ({busy / statistics.mean(ms):.0%} of the '
                 f'mean wall), {launches:.0f} kernels and copies per call')
    return line


def run_core(args, device, note=None):
    """``--mode core``: the attention core alone, with its achieved memory bandwidth."""
    dtype = {'fp32': torch.float32, 'bf16': torch.bfloat16, 'fp16': torch.float16}[args.dtype]
    impls = core_impls(args)
    bad = [i for i in impls if i not in CORE_IMPLS]
    if bad:
        raise SystemExit(f'--mode core: implementations {bad} are not cores; choose from '
                         f'{CORE_IMPLS}')
    if 'triton-w4b64' in impls and (not args.backward or padded_head_dims(args.head_dims) > 32):
        raise SystemExit('--impls triton-w4b64 (the gradient passes launched as up to 0.6.11 at '
                         'head dims up to 32) needs --backward and --head-dims of 32 or less')
    B, h, d = args.batch, args.heads, args.head_dims
    peak_bw = device_peak_bw(device, args.peak_bw)
    results = []
    for grid in args.grid:
        H, W = parse_size(grid)
        N = H * W
        g = torch.Generator(device='cpu').manual_seed(args.seed)
        q, k, v = (torch.randn(B, h, N, d, generator=g).to(device, dtype) for _ in range(3))
        p = (1 + 4 * torch.rand(1, h, 1, d, generator=g)).to(device)
        inv_s = (1 / (0.5 + torch.rand(1, h, 1, d, generator=g))).to(device)
        # least traffic: q, k, v read and the output written once (input dtype); with
        # --backward also q, k, v and the output's gradient read and dq, dk, dv written once
        passes = 11 if args.backward else 4
        if args.attn == 'nala':
            sin, cos = (t.to(device) for t in RoPE2d(d)((H, W)))
            # sin/cos read once per batch item and pass over the keys or queries
            nbytes = passes * B * h * N * d * q.element_size() + \
                B * 2 * sin.numel() * 4 * (2 if args.backward else 1)
            leaves = (q, k, v)
            fns = [nala_core_function(impl, q, k, v, sin, cos) for impl in impls]
        else:
            pe = (0.1 * torch.randn(1, h, N, d, generator=g)).to(device)
            # the float32 position encoding read once per batch item and pass over the keys (with
            # --backward: and its gradient written once)
            nbytes = passes * B * h * N * d * q.element_size() + \
                B * pe.numel() * pe.element_size() * (2 if args.backward else 1) + \
                (pe.numel() * pe.element_size() if args.backward else 0)
            leaves = (q, k, v, p, inv_s, pe)
            fns = [core_function(impl, q, k, v, p, inv_s, pe) for impl in impls]
        if args.backward:
            for t in leaves:
                t.requires_grad_()
            fns = [_core_step(fn, leaves, args.seed) for fn in fns]
        fns = [_in_triton_variant(impl, fn) for impl, fn in zip(impls, fns)]
        variants = [(impl, lambda: None, fn) for impl, fn in zip(impls, fns)]
        meas = measure_interleaved(variants, device, args.warmup, args.repeats, None,
                                   note=note)
        first = meas[impls[0]][2]
        for impl in impls:
            med, times, out, peak, how, _ = meas[impl]
            gbs = nbytes / med / 1e9
            r = dict(target=f'{args.attn}-core-h{h}-d{d}' + ('-train' if args.backward else ''),
                     impl=impl, size=[H, W], pixels=N,
                     batch=B,
                     dtype=args.dtype, latency_ms=med * 1e3, times_ms=[t * 1e3 for t in times],
                     tokens_per_s=B * N / med, peak_mem_mb=peak / 2**20, peak_mem_method=how,
                     min_bytes=nbytes, achieved_gb_s=gbs,
                     bw_fraction=None if peak_bw is None else gbs / peak_bw,
                     max_abs_diff_vs_first_impl=None if impl == impls[0] else
                     max_abs_diff(first, out), max_abs_output=max_abs(out))
            results.append(r)
            frac = '' if peak_bw is None else f' = {gbs / peak_bw:.1%} of {peak_bw:.0f} GB/s'
            diff = '' if impl == impls[0] else \
                f'  max|diff| vs {impls[0]} = {r["max_abs_diff_vs_first_impl"]:.3g}'
            print(f'{r["target"]} {impl:9s} B{B} {H}x{W} {args.dtype}: {med * 1e3:9.3f} ms '
                  f'(min {min(times) * 1e3:.3f}), {nbytes / 2**20:.1f} MiB moved at least, '
                  f'{gbs:8.1f} GB/s{frac}, peak {peak / 2**20:.1f} MB{diff}')
        for base in args.compare or []:
            for r in results[-len(impls):]:
                b = next((x for x in results[-len(impls):] if x['impl'] == base), None)
                if b is not None and r is not b:
                    r['speedup_vs_' + base] = b['latency_ms'] / r['latency_ms']
                    print(f'  {r["impl"]} vs {base}: {r["speedup_vs_" + base]:.2f}x')
        if args.profile:
            for impl, fn in zip(impls, fns):
                print(f'# profile of {impl}, {args.profile} calls, {H}x{W}:')
                print(profile_table(fn, device, args.profile))
        del meas, first
        gc.collect()
    if args.json:
        with open(args.json, 'w') as f:
            json.dump(dict(args=vars(args), torch=torch.__version__, device=str(device),
                           device_name=torch.cuda.get_device_name(device)
                           if device.type == 'cuda' else 'cpu', peak_bw_gb_s=peak_bw,
                           results=results), f, indent=1)
        print(f'wrote {args.json}')
    return results


def _slope(rs, key):
    xs = [math.log(r['pixels']) for r in rs]
    ys = [math.log(max(r[key], 1e-12)) for r in rs]
    if len(xs) < 2:
        return float('nan')
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else float('nan')


def plot(results, path, title):
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(12, 5))
    by = {}
    for r in results:
        by.setdefault(f'{r["target"]} [{r["impl"]}]', []).append(r)
    for ax, key, label in ((axes[0], 'latency_ms', 'latency (ms, median)'),
                           (axes[1], 'peak_mem_mb', 'peak memory (MB)')):
        for name, rs in by.items():
            rs = sorted(rs, key=lambda r: r['pixels'])
            ax.loglog([r['pixels'] for r in rs], [r[key] for r in rs], 'o-',
                      label=f'{name} (slope {_slope(rs, key):.2f})')
        ax.set_xlabel('pixels (H x W)')
        ax.set_ylabel(label)
        ax.grid(True, which='both', alpha=.3)
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(osp.dirname(osp.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)


if __name__ == '__main__':
    main()
