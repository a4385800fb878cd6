"""SyncBN without GPUs: two gloo processes with half a batch each normalise, backpropagate and
update running statistics exactly like one BatchNorm on the whole batch; SyncBN layers of a model
are converted with their parameters and statistics."""
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

from linattn_mm.dist import CPUSyncBatchNorm, convert_sync_batchnorm_for_cpu


def _free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def _worker(rank, world, port, x, w, b, gy, out_dir):
    os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port))
    dist.init_process_group('gloo', rank=rank, world_size=world)
    try:
        bn = CPUSyncBatchNorm(x.shape[1], momentum=0.1)
        with torch.no_grad():
            bn.weight.copy_(w)
            bn.bias.copy_(b)
        half = x.shape[0] // world
        xs = x[rank * half:(rank + 1) * half].clone().requires_grad_(True)
        y = bn(xs)
        (y * gy[rank * half:(rank + 1) * half]).sum().backward()
        torch.save(dict(y=y.detach(), gx=xs.grad, gw=bn.weight.grad, gb=bn.bias.grad,
                        rm=bn.running_mean, rv=bn.running_var),
                   os.path.join(out_dir, f'rank{rank}.pt'))
    finally:
        dist.destroy_process_group()


def test_two_processes_equal_one_batchnorm_on_the_whole_batch(tmp_path):
    torch.manual_seed(0)
    x = torch.randn(4, 3, 5, 6) * 2 + 1
    w, b = torch.rand(3) + 0.5, torch.randn(3)
    gy = torch.randn(4, 3, 5, 6)
    mp.spawn(_worker, args=(2, _free_port(), x, w, b, gy, str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f'rank{r}.pt', weights_only=True) for r in (0, 1))
    ref = nn.BatchNorm2d(3, momentum=0.1)
    with torch.no_grad():
        ref.weight.copy_(w)
        ref.bias.copy_(b)
    xr = x.clone().requires_grad_(True)
    yr = ref(xr)
    (yr * gy).sum().backward()
    torch.testing.assert_close(torch.cat([r0['y'], r1['y']]), yr.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat([r0['gx'], r1['gx']]), xr.grad, rtol=1e-4, atol=1e-5)
    # parameter gradients: the sum over the processes (DDP then averages) is the full-batch one
    torch.testing.assert_close(r0['gw'] + r1['gw'], ref.weight.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(r0['gb'] + r1['gb'], ref.bias.grad, rtol=1e-4, atol=1e-5)
    for r in (r0, r1):
        torch.testing.assert_close(r['rm'], ref.running_mean, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(r['rv'], ref.running_var, rtol=1e-5, atol=1e-6)


def test_single_process_is_plain_batchnorm():
    torch.manual_seed(0)
    x = torch.randn(4, 3, 5, 6)
    a, b = CPUSyncBatchNorm(3), nn.BatchNorm2d(3)
    torch.testing.assert_close(a(x), b(x))
    torch.testing.assert_close(a.running_var, b.running_var)
    a.eval()
    b.eval()
    torch.testing.assert_close(a(x), b(x))


def test_conversion_keeps_parameters_and_statistics():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.SyncBatchNorm(4), nn.ReLU(),
                          nn.Sequential(nn.SyncBatchNorm(4)))
    with torch.no_grad():
        model[1].weight.uniform_()
        model[1].running_mean.uniform_()
    model[3][0].weight.requires_grad_(False)
    sd = model.state_dict()
    conv = convert_sync_batchnorm_for_cpu(model)
    assert isinstance(conv[1], CPUSyncBatchNorm) and isinstance(conv[3][0], CPUSyncBatchNorm)
    assert not any(isinstance(m, nn.SyncBatchNorm) for m in conv.modules())
    assert conv.state_dict().keys() == sd.keys()
    for k, v in conv.state_dict().items():
        assert torch.equal(v, sd[k]), k
    assert not conv[3][0].weight.requires_grad


def _launched_by(monkeypatch, *launchers):
    """The variables the launchers' starters (torchrun, srun, mpirun) give their processes."""
    from linattn_mm.cli import LAUNCHER_ENV
    for launcher in launchers:
        for name in LAUNCHER_ENV[launcher][0]:
            monkeypatch.setenv(name, os.environ.get(name, '1'))


def test_launcher_defaults_select_the_cpu_wrapper(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip('CPU-only behaviour')
    from mmengine.config import Config

    from linattn_mm.cli import apply_launcher_defaults
    _launched_by(monkeypatch, 'slurm')
    cfg = apply_launcher_defaults(Config(dict(launcher='slurm')))
    assert cfg.model_wrapper_cfg == dict(type='CPUDistributedDataParallel', device_ids=None)
    assert cfg.env_cfg.dist_cfg.backend == 'gloo'
    cfg = apply_launcher_defaults(Config(dict(
        launcher='slurm', model_wrapper_cfg=dict(type='MMDistributedDataParallel',
                                                 find_unused_parameters=True))))
    assert cfg.model_wrapper_cfg.type == 'CPUDistributedDataParallel'
    assert cfg.model_wrapper_cfg.find_unused_parameters


def test_more_processes_than_gpus_is_a_clear_error(monkeypatch):
    """A torchrun process whose local rank has no GPU stops with an error naming the counts and
    the two ways out (mmengine's own set-up fails with 'invalid device ordinal')."""
    from mmengine.config import Config

    from linattn_mm.cli import apply_launcher_defaults
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)
    monkeypatch.setattr(torch.cuda, 'device_count', lambda: 1)
    _launched_by(monkeypatch, 'pytorch', 'mpi', 'slurm')
    monkeypatch.setenv('LOCAL_RANK', '1')
    with pytest.raises(RuntimeError, match=r'the process of local rank 1 has no GPU: 1 visible '
                       r'on this node\. Start at most 1 per node \(the process count of '
                       r'tools/dist_train\.sh or tools/dist_test\.sh\), or hide the GPUs'):
        apply_launcher_defaults(Config(dict(launcher='pytorch')))
    monkeypatch.setenv('OMPI_COMM_WORLD_LOCAL_RANK', '3')
    with pytest.raises(RuntimeError, match='the process of local rank 3 has no GPU'):
        apply_launcher_defaults(Config(dict(launcher='mpi')))
    # slurm: mmengine takes the process id modulo the GPU count; its own GPU: left to mmengine
    monkeypatch.setenv('LOCAL_RANK', '0')
    for launcher in ('slurm', 'pytorch'):
        cfg = apply_launcher_defaults(Config(dict(launcher=launcher)))
        assert 'model_wrapper_cfg' not in cfg and 'env_cfg' not in cfg


@pytest.mark.parametrize('launcher,starter', [('pytorch', 'torchrun'), ('slurm', 'srun'),
                                              ('mpi', 'mpirun')])
def test_a_launcher_outside_its_starter_is_a_clear_error(monkeypatch, launcher, starter):
    """--launcher X in a process that X's starter did not start: an error naming the starter and
    the unset variables (mmengine failed with a KeyError of one of them)."""
    from mmengine.config import Config

    from linattn_mm.cli import LAUNCHER_ENV, apply_launcher_defaults
    for name in LAUNCHER_ENV[launcher][0]:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit, match=rf'--launcher {launcher} runs in the processes that '
                                         rf'{starter}.* starts; {LAUNCHER_ENV[launcher][0][0]}'):
        apply_launcher_defaults(Config(dict(launcher=launcher)))
