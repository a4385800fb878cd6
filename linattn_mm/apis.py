"""Python API in the style of ``timm.create_model`` / ``mmpretrain.get_model``.

Every config file in the model zoo (``configs/**.py``, shipped as ``linattn_mm/.mim/configs`` in a
wheel) is a model name: its file stem, e.g. ``swin-t_in1k`` or ``mask-rcnn_swin-t_fpn_1x_coco``.
"""
import copy
import fnmatch
import os
import os.path as osp

SCOPE_REGISTRIES = {
    'mmpretrain': 'mmpretrain.registry',
    'mmdet': 'mmdet.registry',
    'mmseg': 'mmseg.registry',
}


def config_root():
    """The folder holding the model-zoo configs (source checkout or installed package)."""
    here = osp.dirname(osp.abspath(__file__))
    for cand in (osp.join(here, '.mim', 'configs'), osp.join(osp.dirname(here), 'configs')):
        if osp.isdir(cand):
            return cand
    raise FileNotFoundError('linattn_mm configs not found: expected linattn_mm/.mim/configs '
                            '(installed package) or configs/ next to the package (source checkout)')


def _zoo():
    root = config_root()
    zoo = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith('_'))
        for f in sorted(filenames):
            if f.endswith('.py') and not f.startswith('_'):
                zoo[f[:-3]] = osp.join(dirpath, f)
    return zoo


def list_models(pattern=None):
    """Sorted model names (config stems), optionally filtered by a shell-style ``pattern``."""
    names = sorted(_zoo())
    if pattern:
        names = [n for n in names if fnmatch.fnmatch(n, pattern)]
    return names


def get_config(name):
    """The :class:`mmengine.Config` of a zoo model (or of a config file path; a ``Config`` is
    returned as it is)."""
    from mmengine.config import Config
    if isinstance(name, Config):
        return name
    if osp.isfile(name):
        return Config.fromfile(name)
    if str(name).endswith('.py') or '/' in str(name):
        raise FileNotFoundError(f'no config file {name!r} (a zoo model is named without a path '
                                f'or .py: see linattn_mm.list_models())')
    zoo = _zoo()
    if name not in zoo:
        import difflib
        norm = {n.replace('_', '-').lower(): n for n in zoo}
        close = [norm[n] for n in difflib.get_close_matches(
            str(name).replace('_', '-').lower(), list(norm), n=6, cutoff=0.6)]
        raise KeyError(f'unknown model {name!r}; {len(zoo)} models are available, see '
                       f'linattn_mm.list_models()' + (f'; similar: {close}' if close else ''))
    return Config.fromfile(zoo[name])


def _merge(dst, src):
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            _merge(dst[k], v)
        else:
            dst[k] = v
    return dst


def build_model(name, pretrained_backbone=True, **kwargs):
    """Build (without initialising or loading weights) the model of a zoo config, config file or
    :class:`mmengine.Config`, in its library's registry and scope.

    Args:
        name (str | Config): model name from :func:`list_models`, a config file or a Config.
        pretrained_backbone (bool): keep the backbone's ``Pretrained`` init_cfg (False drops it,
            e.g. to count parameters and FLOPs, or when a whole checkpoint is loaded later).
        **kwargs: merged into the config's ``model`` dict, e.g. ``backbone=dict(drop_path_rate=0)``.
    """
    import linattn_mm  # noqa: F401  (registration)
    import importlib
    from mmengine.config import ConfigDict
    from mmengine.registry import DefaultScope
    cfg = get_config(name)
    model_cfg = ConfigDict(_merge(cfg.model.to_dict(), copy.deepcopy(kwargs)))
    # mmpretrain configs keep the normalisation at the top level; the runner (and the libraries'
    # init_model) hand it to the model unless the model has its own
    if cfg.get('data_preprocessor') is not None:
        model_cfg.setdefault('data_preprocessor', copy.deepcopy(cfg.data_preprocessor))
    scope = cfg.get('default_scope', 'mmpretrain')
    if scope not in SCOPE_REGISTRIES:
        raise ValueError(f'config {name!r} has default_scope {scope!r}; expected one of '
                         f'{sorted(SCOPE_REGISTRIES)}')
    registry = importlib.import_module(SCOPE_REGISTRIES[scope]).MODELS
    if not pretrained_backbone:
        bb = model_cfg.get('backbone', {})
        if isinstance(bb.get('init_cfg'), dict) and bb['init_cfg'].get('type') == 'Pretrained':
            bb.pop('init_cfg')
    with DefaultScope.overwrite_default_scope(scope):
        return registry.build(model_cfg)


def get_model(name, pretrained=None, device=None, allow_unsafe_pickle=None, convert=True,
              min_loaded=0.5, **kwargs):
    """Build the model of a zoo config (or config file), in eval mode, for inference.

    Args:
        name (str): model name from :func:`list_models`, or a path to a config file.
        pretrained (str, optional): checkpoint to load. A file with ``backbone.*`` keys (an
            mmpretrain/mmdet/mmseg checkpoint) is loaded into the whole model, except a
            classifier's file (only ``backbone.*`` and ``head.*``) for a model with other parts (a
            detector's neck and heads), which fills its backbone; any other file (an official
            ImageNet checkpoint, a raw state dict) goes into ``model.backbone``. The load report
            (missing / unexpected / resized keys) is kept as ``model.load_report``. Without it
            the config's own backbone file (its ``Pretrained`` init_cfg, an ImageNet checkpoint)
            is loaded, as in training; ``backbone=dict(init_cfg=None)`` builds random weights.
        device (str, optional): move the model there.
        allow_unsafe_pickle (bool, optional): opt in to full pickle loading of trusted files.
        convert (bool): an inference model: the blocks and mixers get their inference forms for
            the model's device (:func:`linattn_mm.deploy.convert`; same outputs, faster) and the
            parameters are frozen (``requires_grad=False``), so calling the model needs no
            ``torch.no_grad()``. False keeps the plain forms and trainable parameters, e.g. to
            train or fine-tune the model, or to register forward hooks inside blocks. Defaults to
            True.
        min_loaded (float): the share of the parameter values of what is loaded (the model or
            its backbone) the file must fill (:func:`linattn_mm.checkpoint.load_pretrained`); 0
            loads whatever matches. Defaults to 0.5.
        **kwargs: merged into the config's ``model`` dict, e.g. ``backbone=dict(drop_path_rate=0)``.
    """
    from linattn_mm.checkpoint import (extract_state_dict, load_pretrained, safe_load,
                                       strip_prefixes)
    from linattn_mm.utils.progress import quiet_init_log
    # with a checkpoint the whole model is loaded below: not the backbone's own init checkpoint
    model = build_model(name, pretrained_backbone=pretrained is None, **kwargs)
    with quiet_init_log():  # not the per-parameter init log (a load report that finds missing
        model.init_weights()  # or unexpected keys is a warning: it still shows)
    if pretrained is not None:
        ckpt = safe_load(pretrained, allow_unsafe_pickle=allow_unsafe_pickle)
        state, _ = strip_prefixes(extract_state_dict(ckpt)[0], '')  # without DDP's module.
        whole = any(k.startswith('backbone.') for k in state)
        if whole and hasattr(model, 'backbone'):  # a classifier's file for a detector: backbone
            classifier = {'backbone', 'head', 'data_preprocessor'}
            whole = not ({k.split('.')[0] for k in state} <= classifier and
                         {k.split('.')[0] for k in model.state_dict()} - classifier)
        if whole or not hasattr(model, 'backbone'):
            model.load_report = load_pretrained(model, ckpt, prefix=None,
                                                allow_unsafe_pickle=allow_unsafe_pickle,
                                                min_loaded=min_loaded)
        else:
            model.load_report = load_pretrained(model.backbone, ckpt, prefix=None,
                                                allow_unsafe_pickle=allow_unsafe_pickle,
                                                min_loaded=min_loaded)
            _load_official_head(model, state)
    if device is not None:
        model.to(device)
    model.eval()
    if convert:
        from linattn_mm.deploy import convert as convert_model
        convert_model(model.requires_grad_(False))
    return model


def _load_official_head(model, state):
    """Official classification files keep the linear classifier as ``head.weight``/``head.bias``;
    mmpretrain's ``LinearClsHead`` / ``VisionTransformerClsHead`` call it ``head.fc`` /
    ``head.layers.head``. Copy it when the shapes agree, so the classifier's logits are the official
    model's."""
    import torch
    head = getattr(model, 'head', None)
    if head is None or 'head.weight' not in state:
        return
    linear = getattr(head, 'fc', None)
    if linear is None and hasattr(head, 'layers'):
        linear = getattr(head.layers, 'head', None)
    if not isinstance(linear, torch.nn.Linear):
        return
    w, b = state['head.weight'], state.get('head.bias')
    if tuple(w.shape) != tuple(linear.weight.shape):
        model.load_report.notes['head.weight'] = (
            f'classifier head not loaded: checkpoint {tuple(w.shape)} vs model '
            f'{tuple(linear.weight.shape)}')
        return
    with torch.no_grad():
        linear.weight.copy_(w)
        if b is not None and linear.bias is not None:
            linear.bias.copy_(b)
    for k in ('head.weight', 'head.bias'):
        model.load_report.dropped.pop(k, None)
        model.load_report.loaded.append(k)
