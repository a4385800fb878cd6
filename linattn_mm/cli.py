"""Command-line set-up shared by ``tools/train.py`` and ``tools/test.py``: their common flags, the
config with ``--demo`` / ``--cfg-options`` / the work dir applied, launcher defaults for runs
without GPUs, building mmengine's runner, and finding the checkpoint to resume from."""
import copy
import os
import os.path as osp

import torch


def add_common_args(parser):
    """The flags every tool shares: ``--work-dir --demo --cfg-options --launcher --local-rank``."""
    from mmengine.config import DictAction
    parser.add_argument('--work-dir', help='directory for logs and checkpoints')
    parser.add_argument('--demo', action='store_true',
                        help='the demo overlay: the generated demo data under data/demo '
                        '(tools/make_demo_data.py), a tiny schedule, no pretrained backbone file, '
                        'the CPU settings (linattn_mm.demo.apply_demo); --cfg-options apply '
                        'after it')
    parser.add_argument('--cfg-options', nargs='+', action=DictAction,
                        help='override config settings, e.g. train_cfg.max_epochs=1')
    parser.add_argument('--launcher', choices=['none', 'pytorch', 'slurm', 'mpi'],
                        default='none')
    parser.add_argument('--local_rank', '--local-rank', type=int, default=0)
    return parser


def parse_with_common(parser, argv=None):
    args = parser.parse_args(argv)
    if 'LOCAL_RANK' not in os.environ:
        os.environ['LOCAL_RANK'] = str(args.local_rank)
    return args


def load_config(args):
    """The config of ``args.config`` with the demo overlay (``--demo``), ``--cfg-options``, the
    launcher and the work dir (CLI, then the config's ``work_dir``, then ``work_dirs/<config
    name>``, with ``_demo`` appended under ``--demo``) applied."""
    from mmengine.config import Config
    if osp.isfile(args.config):
        cfg = Config.fromfile(args.config)
    else:
        name = args.config
        if name.endswith('.py') or '/' in name or os.sep in name:
            raise SystemExit(f'error: no config file {name!r}')
        from linattn_mm.apis import get_config
        try:  # a model-zoo name (linattn_mm.list_models()): its config file, read once
            cfg = get_config(name)
        except KeyError as e:
            raise SystemExit(f'error: no config file {name!r}, nor a model-zoo name: '
                             f'{e.args[0]}') from None
        args.config = cfg.filename
    demo = getattr(args, 'demo', False)
    if demo:
        from linattn_mm.demo import DEMO_ROOT, apply_demo
        options = args.cfg_options or {}
        if not osp.isdir(DEMO_ROOT) and not any(k.endswith('data_root') for k in options):
            raise SystemExit(f'error: --demo trains and tests on the generated demo data in '
                             f'{DEMO_ROOT}/ of the working directory ({os.getcwd()}), which has '
                             f'none: run python tools/make_demo_data.py there first (tools/demo.sh '
                             f'does), or run from the repository root')
        backbone = cfg.get('model', {}).get('backbone') or {}
        own_init = copy.deepcopy(backbone.get('init_cfg'))
        apply_demo(cfg)
        # the overlay drops the backbone's pretrained file; an option that sets one starts from
        # the config's own init_cfg (merging it into the overlay's None fails)
        if own_init is not None and 'model.backbone.init_cfg.checkpoint' in options:
            cfg.model.backbone.init_cfg = own_init
    cfg.launcher = args.launcher
    if args.cfg_options is not None:
        cfg.merge_from_dict(args.cfg_options)
    if args.work_dir is not None:
        cfg.work_dir = args.work_dir
    elif cfg.get('work_dir', None) is None:
        name = osp.splitext(osp.basename(args.config))[0] + ('_demo' if demo else '')
        cfg.work_dir = osp.join('./work_dirs', name)
    return cfg


def _flip_tta_pipeline(test_pipeline, pack):
    """The test pipeline with its last step (the packing) replaced by horizontal flip / no flip,
    each packed by ``pack``: the default test-time augmentation of mmdet's and mmpretrain's
    test tools."""
    pipeline = copy.deepcopy(list(test_pipeline))
    pipeline[-1] = dict(type='TestTimeAug', transforms=[
        [dict(type='RandomFlip', prob=1.), dict(type='RandomFlip', prob=0.)], [pack]])
    return pipeline


def apply_tta(cfg, scope):
    """``--tta`` of tools/test.py, as each library's own test tool: the model wrapped in the
    config's ``tta_model`` and the test set on its ``tta_pipeline``. mmdet and mmpretrain configs
    without them get those tools' defaults (flip test-time augmentation; a warning says so);
    mmseg's tool has none, so they are required there."""
    import warnings
    missing = [k for k in ('tta_model', 'tta_pipeline') if k not in cfg]
    if missing and scope == 'mmseg':
        raise SystemExit(f'error: --tta needs {" and ".join(missing)} in the config (mmseg\'s '
                         f'test tool has no default)')
    test_set = cfg.test_dataloader.dataset
    while 'dataset' in test_set:  # inside dataset wrappers
        test_set = test_set['dataset']
    if 'tta_model' not in cfg:
        cfg.tta_model = dict(type='DetTTAModel', tta_cfg=dict(
            nms=dict(type='nms', iou_threshold=0.5), max_per_img=100)) if scope == 'mmdet' \
            else dict(type='mmpretrain.AverageClsScoreTTA')
    if 'tta_pipeline' not in cfg:
        pack = dict(type='PackDetInputs', meta_keys=(
            'img_id', 'img_path', 'ori_shape', 'img_shape', 'scale_factor', 'flip',
            'flip_direction')) if scope == 'mmdet' else copy.deepcopy(test_set.pipeline[-1])
        cfg.tta_pipeline = _flip_tta_pipeline(test_set.pipeline, pack)
    if missing:
        warnings.warn(f'--tta: the config has no {" or ".join(missing)}; using the {scope} test '
                      f'tool\'s default (flip test-time augmentation)')
    if str(cfg.tta_model.get('type', '')).split('.')[-1] == 'DetTTAModel' and \
            _has_key(cfg.model, 'mask_head'):
        raise SystemExit('error: --tta: mmdet\'s DetTTAModel merges boxes only, and this model '
                         'predicts masks (it has a mask_head): test it without --tta')
    cfg.model = dict(**cfg.tta_model, module=cfg.model)
    cfg.test_dataloader.dataset.pipeline = cfg.tta_pipeline


def _has_key(tree, key):
    if isinstance(tree, dict):
        return key in tree or any(_has_key(v, key) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return any(_has_key(v, key) for v in tree)
    return False


def apply_launcher_defaults(cfg):
    """Make multi-process runs work without CUDA: the gloo backend (nccl needs GPUs), the
    process group created here for the ``pytorch`` (torchrun) launcher (mmengine's own set-up
    calls ``torch.cuda.set_device``), and DDP without device ids whose SyncBN layers synchronise
    over gloo (:class:`linattn_mm.dist.CPUDistributedDataParallel`). With CUDA, a torchrun
    process whose local rank has no GPU (more processes per node than GPUs) stops with an error
    that says so, before mmengine's ``torch.cuda.set_device`` fails on it."""
    if cfg.get('launcher', 'none') == 'none':
        return cfg
    need, starter = LAUNCHER_ENV.get(cfg.launcher, ((), None))
    unset = [v for v in need if v not in os.environ]
    if unset:
        raise SystemExit(f'error: --launcher {cfg.launcher} runs in the processes that {starter} '
                         f'starts; '
                         f'{", ".join(unset)} {"is" if len(unset) == 1 else "are"} not set here. '
                         f'Start the tool that way, or run one process with --launcher none')
    if torch.cuda.is_available():
        check_local_gpu(cfg.launcher)
        return cfg
    env = dict(cfg.get('env_cfg') or {})
    env['dist_cfg'] = dict(env.get('dist_cfg') or {}, backend='gloo')
    cfg.env_cfg = env
    if cfg.launcher == 'pytorch':
        import torch.distributed as dist
        if not dist.is_initialized():
            dist.init_process_group(backend='gloo')
    # SyncBN layers become CPUSyncBatchNorm (statistics all-reduced over the gloo group)
    import linattn_mm.dist  # noqa: F401  (registers the wrapper)
    wrapper = dict(cfg.get('model_wrapper_cfg') or dict(type='CPUDistributedDataParallel'))
    if wrapper.get('type') == 'MMDistributedDataParallel':
        wrapper['type'] = 'CPUDistributedDataParallel'
    wrapper.setdefault('device_ids', None)
    cfg.model_wrapper_cfg = wrapper
    return cfg


#: the variables each launcher's processes get from what starts them, and what that is
LAUNCHER_ENV = {
    'pytorch': (('RANK', 'WORLD_SIZE', 'MASTER_ADDR', 'MASTER_PORT'),
                'torchrun (tools/dist_train.sh, tools/dist_test.sh)'),
    'slurm': (('SLURM_PROCID', 'SLURM_NTASKS', 'SLURM_NODELIST'), 'srun'),
    'mpi': (('OMPI_COMM_WORLD_LOCAL_RANK', 'OMPI_COMM_WORLD_RANK', 'OMPI_COMM_WORLD_SIZE',
             'MASTER_ADDR'),
            'mpirun (Open MPI, with MASTER_ADDR exported)'),
}

#: the variable of the local rank, by launcher, where mmengine takes the GPU of that index (the
#: slurm launcher takes the process id modulo the GPU count)
LOCAL_RANK_VARIABLES = {'pytorch': 'LOCAL_RANK', 'mpi': 'OMPI_COMM_WORLD_LOCAL_RANK'}


def check_local_gpu(launcher):
    """Raise if this process (torchrun or mpirun) has no GPU of its own on its node."""
    name = LOCAL_RANK_VARIABLES.get(launcher)
    if name is None:
        return
    local_rank, count = int(os.environ.get(name, 0)), torch.cuda.device_count()
    if local_rank >= count:
        raise RuntimeError(
            f'the process of local rank {local_rank} has no GPU: {count} visible on this node. '
            f'Start at most {count} per node (the process count of tools/dist_train.sh or '
            f'tools/dist_test.sh), or hide the GPUs (CUDA_VISIBLE_DEVICES=) to run CPU processes '
            f'over gloo')


def close_process_group(wait=True):
    """Destroy the default process group (if any), after a barrier when ``wait`` (a failed rank
    must not wait for the others). Leaving gloo's worker threads alive until interpreter shutdown
    can abort a process at exit ("terminate called without an active exception") after a
    successful run."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        try:
            if wait:
                dist.barrier()
        finally:
            dist.destroy_process_group()


def set_attention_core(model, core):
    """Put every Pola mixer (``PolaLinearAttention``) and NaLa mixer (``NormAwareLinearAttention``)
    of a built ``model`` on the core ``core`` (:data:`linattn_mm.ops.dispatch.CORES`; ``'triton'``:
    the Triton kernels, forward and backward, CUDA; ``'fused'``: the torch cores' products with
    their elementwise passes in Triton, CUDA; NaLaFormer blocks then run their conv sums as
    Triton kernels too, ``ffn_core='fused'``, every NaLa mixer, softmax ones included, its
    gated output, ``gate_core='fused'``, and the softmax mixers their RoPE, ``core='fused'``) and
    return how many Pola and NaLa mixers there are. A
    ``ValueError`` when the model has none, for an unknown core name, for ``'triton'`` or
    ``'fused'`` where the model is not on a CUDA device (or Triton is missing), or for a NaLa mixer
    whose feature map has no such core (the paper's kernel, a constant query power), naming it."""
    from linattn_mm.models.attentions.nala import NormAwareLinearAttention
    from linattn_mm.models.attentions.pola import PolaLinearAttention
    from linattn_mm.ops.dispatch import check_core, triton_available
    from linattn_mm.ops.nala import OFFICIAL_ONLY_CORES, core_refusal
    check_core('--attn-core', core)
    mixers = [(name, m) for name, m in model.named_modules()
              if isinstance(m, (PolaLinearAttention, NormAwareLinearAttention))]
    if not mixers:
        raise ValueError(f'--attn-core {core}: the model has no Pola or NaLa mixer')
    device = next(model.parameters()).device
    if core in ('triton', 'fused') and not triton_available(device):
        raise ValueError(f'--attn-core {core}: the model is on {device}; the Triton kernels run '
                         f'on CUDA (with Triton installed)')
    for name, m in mixers:
        if isinstance(m, NormAwareLinearAttention) and core_refusal(core, m.kernel,
                                                                   m.query_power):
            raise ValueError(f"--attn-core {core}: {name} (kernel={m.kernel!r}, query_power="
                             f"{m.query_power}) has no {OFFICIAL_ONLY_CORES[core]} core (the "
                             f"official kernel only)")
    set_fused_forms(model, core == 'fused')
    for _, m in mixers:
        m.core = core
    return len(mixers)


def set_fused_forms(model, fused):
    """Put the Triton forms that ``--attn-core fused`` adds to the fused cores on (``fused``) or
    off: NaLaFormer blocks' conv sums (``ffn_core``), every NaLa mixer's gated output
    (``gate_core``, softmax mixers included) and the softmax mixers' RoPE (their ``core``). The
    blocks' convs are checked first: a refused one leaves everything as it was."""
    from linattn_mm.models.attentions.nala import set_fused_gates, set_fused_rope
    from linattn_mm.models.backbones.nalaformer import set_fused_blocks
    set_fused_blocks(model, fused)  # checks its convs before it switches anything
    set_fused_gates(model, fused)
    set_fused_rope(model, fused)


def checkpoint_file_problem(path):
    """Why the file ``path`` cannot be a checkpoint, seen from its first byte and its zip
    directory only (the runner reads it whole, once, later), or None. URLs and OpenMMLab names
    (``scheme://...``) are taken as they are: the loader fetches them."""
    import zipfile
    if '://' in str(path):
        return None
    if not osp.isfile(path):
        return f'no checkpoint file {path!r}'
    if zipfile.is_zipfile(path):  # torch's format: its directory sits at the end of the file
        return None
    with open(path, 'rb') as f:
        if f.read(1) == b'\x80':  # torch's legacy format: a pickle
            return None
    return (f'{path!r} ({osp.getsize(path)} bytes) is truncated or not a torch checkpoint '
            f'(incomplete download? re-download it)')


class CheckpointMismatch(RuntimeError):
    """A checkpoint to evaluate does not fit the model of the config."""


def check_test_checkpoint(model, checkpoint, name, partial=False, shown=4):
    """Raise :class:`CheckpointMismatch` when ``checkpoint`` (the dict mmengine's runner loaded
    from the file ``name``) lacks parameters of ``model`` (the model to evaluate, inside any
    wrappers) or holds them in other shapes: the runner loads what matches and evaluates the rest
    at its initial values with a warning. The dict is read as the runner reads it (its
    ``state_dict``, else the whole dict; ``module.`` prefixes dropped); a shape is not checked
    under a module that resizes what it loads (a load_state_dict pre-hook, as mmpretrain's ViT and
    Swin have for their position tables). ``partial``: only warn."""
    import warnings
    from collections.abc import Mapping

    from mmengine.model import BaseTTAModel, is_model_wrapper
    while is_model_wrapper(model) or isinstance(model, BaseTTAModel):
        model = model.module
    state = checkpoint.get('state_dict', checkpoint) if isinstance(checkpoint, Mapping) else {}
    state = {k[len('module.'):] if k.startswith('module.') else k: v for k, v in state.items()
             if torch.is_tensor(v)}
    resizing = [n + '.' for n, m in model.named_modules() if m._load_state_dict_pre_hooks]
    params = dict(model.named_parameters())
    missing = [k for k in params if k not in state]
    other = [f"'{k}': checkpoint {tuple(state[k].shape)}, model {tuple(p.shape)}"
             for k, p in params.items() if k in state and state[k].shape != p.shape
             and not any(r == '.' or k.startswith(r) for r in resizing)]
    if not missing and not other:
        return
    problem = (f'checkpoint {name!r} does not fit the model of the config: '
               + '; '.join(filter(None, [
                   missing and f'{len(missing)} of its {len(params)} parameters are missing '
                               f'(e.g. {", ".join(map(repr, missing[:shown]))})',
                   other and f'{len(other)} have other shapes ({"; ".join(other[:shown])})'])))
    if partial:
        warnings.warn(problem + '; evaluating anyway (--partial-checkpoint): those parameters '
                      'keep their initial values')
        return
    raise CheckpointMismatch(problem + '. Evaluate the checkpoint with the config it was trained '
                             'with, or pass --partial-checkpoint to evaluate anyway (those '
                             'parameters keep their initial values)')


def checkpoint_fit_hook(name, partial=False):
    """A runner hook that runs :func:`check_test_checkpoint` on the checkpoint the runner has just
    read from ``name``, before it fills the model (the file is read once)."""
    from mmengine.hooks import Hook

    class CheckpointFitHook(Hook):
        def after_load_checkpoint(self, runner, checkpoint):
            check_test_checkpoint(runner.model, checkpoint, name, partial)
    return CheckpointFitHook()


def build_runner(cfg):
    """The config's runner (``runner_type`` if set, else mmengine's Runner)."""
    from mmengine.registry import RUNNERS
    from mmengine.runner import Runner
    if 'runner_type' in cfg:
        return RUNNERS.build(cfg)
    return Runner.from_cfg(cfg)


def _checkpoint_number(name):
    import re
    m = re.fullmatch(r'(?:epoch|iter)_(\d+)\.pth', name)
    return int(m.group(1)) if m else None


def is_complete_checkpoint(path):
    """True when ``path`` is a whole torch zip checkpoint (a run killed while saving leaves a
    truncated file behind)."""
    import zipfile
    try:
        with zipfile.ZipFile(path) as zf:
            return zf.testzip() is None
    except (zipfile.BadZipFile, OSError, EOFError):
        return False


def find_resume_checkpoint(work_dir):
    """The newest complete ``epoch_*.pth`` / ``iter_*.pth`` in ``work_dir`` (mmengine's
    ``last_checkpoint`` pointer first when it names a complete file), or None."""
    if not osp.isdir(work_dir):
        return None
    numbered = sorted(((n, f) for f in os.listdir(work_dir)
                       for n in [_checkpoint_number(f)] if n is not None), reverse=True)
    # newest first, and only until one is complete: each check reads the whole file
    newest = next((osp.join(work_dir, f) for _, f in numbered
                   if is_complete_checkpoint(osp.join(work_dir, f))), None)
    pointer = osp.join(work_dir, 'last_checkpoint')
    if osp.isfile(pointer):
        with open(pointer) as f:
            named = f.read().strip()
        number = _checkpoint_number(osp.basename(named))
        newer = newest is None or (number is not None and
                                   number > _checkpoint_number(osp.basename(newest)))
        if named != newest and newer and osp.isfile(named) and is_complete_checkpoint(named):
            return named
    return newest
