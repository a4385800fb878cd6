"""Helpers shared by ``tools/train.py`` and ``tools/test.py``."""
import torch


def apply_launcher_defaults(cfg):
    """Distributed runs without CUDA use the gloo backend (nccl needs GPUs)."""
    if cfg.get('launcher', 'none') != 'none' and not torch.cuda.is_available():
        env = cfg.setdefault('env_cfg', {})
        dist = env.setdefault('dist_cfg', {})
        dist['backend'] = 'gloo'
    return cfg


def build_runner(cfg):
    """The config's runner (``runner_type`` if set, else mmengine's Runner)."""
    from mmengine.registry import RUNNERS
    from mmengine.runner import Runner
    if 'runner_type' in cfg:
        return RUNNERS.build(cfg)
    return Runner.from_cfg(cfg)
