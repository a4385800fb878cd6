"""Multi-process training without GPUs: synchronised BatchNorm over a CPU (gloo) process group.

PyTorch's ``nn.SyncBatchNorm`` only runs on GPUs, and mmengine reverts SyncBN to plain BatchNorm
only for single-process runs. With ``tools/dist_train.sh`` on CPUs the runner therefore wraps the
model in :class:`CPUDistributedDataParallel`, which replaces every SyncBN by
:class:`CPUSyncBatchNorm`: the batch statistics are summed over all processes (one all-reduce per
layer, differentiable), so N processes with B images each normalise exactly like one process
with N·B images.
"""
import torch
import torch.distributed as dist
import torch.nn as nn
from mmengine.model import MMDistributedDataParallel
from mmengine.registry import MODEL_WRAPPERS
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = ['CPUSyncBatchNorm', 'convert_sync_batchnorm_for_cpu', 'CPUDistributedDataParallel']


class CPUSyncBatchNorm(_BatchNorm):
    """BatchNorm whose training statistics are computed over every process of the default group
    (any backend, including gloo on CPU). Outside training, or in a single process, it is a plain
    BatchNorm. Same parameters and buffers as ``nn.SyncBatchNorm`` (state dicts are
    interchangeable)."""

    def _check_input_dim(self, x):
        if x.dim() < 2:
            raise ValueError(f'expected at least 2-D input, got {x.dim()}-D')

    def forward(self, x):
        self._check_input_dim(x)
        synced = self.training and dist.is_available() and dist.is_initialized() and \
            dist.get_world_size() > 1
        if not synced:
            return super().forward(x)
        from torch.distributed.nn.functional import all_reduce
        C = x.shape[1]
        dims = [0] + list(range(2, x.dim()))
        xf = x.float()
        local = torch.cat([xf.sum(dims), (xf * xf).sum(dims),
                           xf.new_full((1, ), x.numel() / C)])
        total = all_reduce(local)  # differentiable sum over the processes
        s, ss, n = total[:C], total[C:2 * C], total[2 * C]
        mean = s / n
        var = (ss / n - mean * mean).clamp(min=0)
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked += 1
                m = self.momentum if self.momentum is not None else \
                    1.0 / float(self.num_batches_tracked)
                self.running_mean.mul_(1 - m).add_(mean.detach() * m)
                self.running_var.mul_(1 - m).add_(var.detach() * (n / max(n - 1, 1)) * m)
        shape = [1, C] + [1] * (x.dim() - 2)
        y = (xf - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        return y.to(x.dtype)


def convert_sync_batchnorm_for_cpu(module):
    """Replace every ``nn.SyncBatchNorm`` (and mmcv's ``SyncBatchNorm``) in ``module`` by a
    :class:`CPUSyncBatchNorm` with the same parameters and statistics."""
    sync_types = [nn.SyncBatchNorm]
    try:
        from mmcv.ops import SyncBatchNorm as MMCVSyncBN
        sync_types.append(MMCVSyncBN)
    except Exception:  # mmcv without compiled ops
        pass
    out = module
    if isinstance(module, tuple(sync_types)):
        out = CPUSyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                               module.track_running_stats)
        if module.affine:
            with torch.no_grad():
                out.weight.copy_(module.weight)
                out.bias.copy_(module.bias)
            out.weight.requires_grad_(module.weight.requires_grad)
            out.bias.requires_grad_(module.bias.requires_grad)
        if module.track_running_stats:
            out.running_mean.copy_(module.running_mean)
            out.running_var.copy_(module.running_var)
            out.num_batches_tracked.copy_(module.num_batches_tracked)
        out.train(module.training)
    for name, child in module.named_children():
        new = convert_sync_batchnorm_for_cpu(child)
        if new is not child:
            out.add_module(name, new)
    return out


@MODEL_WRAPPERS.register_module()
class CPUDistributedDataParallel(MMDistributedDataParallel):
    """mmengine's DDP wrapper for CPU process groups: converts SyncBN layers to
    :class:`CPUSyncBatchNorm` before wrapping (``tools/train.py`` selects it when no GPU is
    available and a launcher is used)."""

    def __init__(self, module, **kwargs):
        kwargs.setdefault('device_ids', None)
        super().__init__(module=convert_sync_batchnorm_for_cpu(module), **kwargs)
