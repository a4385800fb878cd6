"""The loading pipeline: :func:`load_pretrained` (into a model) and :func:`convert_checkpoint`
(offline, into a tensors-only file).

Pipeline::

    safe_load -> extract_state_dict -> strip_prefixes -> model.convert_pretrained_state_dict (hook)
      -> drop ignored keys -> resize mismatched shapes (the owning module's
      resize_checkpoint_tensor) -> load_state_dict -> LoadReport (logged; strict mode raises)

Hooks a model may define
------------------------
``convert_pretrained_state_dict(self, state_dict) -> dict`` (on the model loaded into)
    Called with the unwrapped, prefix-stripped state dict; returns a new dict (typically renaming
    keys of an official checkpoint to this implementation's names).
``pretrained_ignore_keys`` (iterable of regex strings, class or instance attribute of the model)
    Checkpoint keys matching any of them (``re.search``) are dropped and reported; model keys
    matching them are not reported as missing (the model initialises them itself).
``resize_checkpoint_tensor(self, name, src) -> (tensor, note) | None`` (on any submodule)
    Called when the checkpoint tensor of one of the module's own parameters/buffers (``name`` is
    local to the module, e.g. ``'positional_encoding'``) has another shape than the model's. Returns
    the tensor in the module's shape and a note for the report (may be ``''``), ``None`` for names
    it does not resize, and raises :class:`CheckpointError` when the conversion is impossible. The
    helpers of :mod:`linattn_mm.checkpoint.resize` cover the common layouts.
"""
import collections
import logging
import os
import re
from typing import Dict, List, Mapping, Optional, Tuple

import torch

from .errors import CheckpointError
from .loading import safe_load
from .report import LoadReport, format_keys
from .resize import owner_of, resize_with_owner
from .state_dict import strip_prefixes, unwrap_checkpoint

__all__ = ['load_pretrained', 'convert_checkpoint', 'DEFAULT_IGNORE_BUFFER_KEYS',
           'DEFAULT_HEAD_KEYS']

#: checkpoint keys of buffers every model recomputes at construction; always dropped from
#: checkpoints and never reported as missing
DEFAULT_IGNORE_BUFFER_KEYS = (r'relative_position_index$', r'attn_mask$',
                              r'relative_coords_table$')

#: classifier heads of the source model; dropped unless the model has the same key with the same
#: shape
DEFAULT_HEAD_KEYS = (r'^head\.', r'^fc\.')


def _ckpt_name(checkpoint) -> str:
    if isinstance(checkpoint, (str, os.PathLike)):
        return os.fspath(checkpoint)
    return '<in-memory dict>'


def _load_any(checkpoint, map_location, allow_unsafe_pickle):
    if isinstance(checkpoint, (Mapping, torch.nn.Module)):
        return checkpoint
    return safe_load(checkpoint, map_location=map_location,
                     allow_unsafe_pickle=allow_unsafe_pickle)


def _apply_model_pipeline(model: torch.nn.Module, sd: Dict[str, torch.Tensor], report: LoadReport,
                          name: str) -> Tuple[Dict[str, torch.Tensor], Dict[str, torch.Tensor],
                                              List['re.Pattern']]:
    """Hook, ignore patterns, matching and resizing against ``model`` (no loading).

    Returns ``(matched, model_state, ignore_patterns)`` where ``matched`` holds the tensors to load
    (already in the model's shapes); fills ``report.unexpected/dropped/resized/notes``.
    """
    hook = getattr(model, 'convert_pretrained_state_dict', None)
    if callable(hook):
        new_sd = hook(sd)
        if not isinstance(new_sd, Mapping):
            raise CheckpointError(
                f'{type(model).__name__}.convert_pretrained_state_dict must return a dict, got '
                f'{type(new_sd).__name__}')
        sd = collections.OrderedDict(new_sd)
    model_state = model.state_dict()
    model_ignore = [re.compile(p) for p in getattr(model, 'pretrained_ignore_keys', ()) or ()]
    buffer_ignore = [re.compile(p) for p in DEFAULT_IGNORE_BUFFER_KEYS]
    head_keys = [re.compile(p) for p in DEFAULT_HEAD_KEYS]

    kept = collections.OrderedDict()
    for k, v in sd.items():
        if any(rx.search(k) for rx in model_ignore):
            report.dropped[k] = f"{type(model).__name__}.pretrained_ignore_keys"
        elif any(rx.search(k) for rx in buffer_ignore):
            report.dropped[k] = 'recomputed buffer'
        elif (any(rx.search(k) for rx in head_keys)
              and not (k in model_state and model_state[k].shape == v.shape)):
            report.dropped[k] = 'classifier head of the source model'
        else:
            kept[k] = v

    matched_keys = [k for k in kept if k in model_state]
    if not matched_keys:
        raise CheckpointError(
            f"checkpoint '{name}' matches none of the model's {len(model_state)} parameters/"
            f"buffers ({type(model).__name__}). Checkpoint keys ({len(kept)} after unwrapping "
            f"'{report.source}'): {format_keys(list(kept), 6)}; model keys: "
            f'{format_keys(list(model_state), 6)}. If the weights sit under a prefix, pass it as '
            f"prefix='backbone.' (or whatever it is); a renaming belongs in "
            f'{type(model).__name__}.convert_pretrained_state_dict.')
    report.unexpected = [k for k in kept if k not in model_state]

    matched = collections.OrderedDict()
    for k in matched_keys:
        v, target = kept[k], model_state[k]
        if v.shape != target.shape:
            res = resize_with_owner(model, k, v, target.shape)
            if res is None:
                owner, local = owner_of(model, k)
                raise CheckpointError(
                    f"shape mismatch for '{k}' in checkpoint '{name}': checkpoint "
                    f'{tuple(v.shape)} vs model {tuple(target.shape)}, and its module '
                    f'({type(owner).__name__}) does not resize {local!r} (a module resizes its '
                    f'own tensors in resize_checkpoint_tensor(name, src); or list the key in '
                    f'{type(model).__name__}.pretrained_ignore_keys)')
            new, note = res
            report.resized[k] = (tuple(v.shape), tuple(target.shape))
            if note:
                report.notes[k] = note
            v = new
        matched[k] = v
    ignore_all = model_ignore + buffer_ignore
    return matched, model_state, ignore_all


def load_pretrained(model: torch.nn.Module, checkpoint, prefix: Optional[str] = None,
                    map_location='cpu', allow_unsafe_pickle: Optional[bool] = None,
                    prefer_ema: bool = True, strict: bool = False,
                    logger=None, min_loaded: float = 0.5) -> LoadReport:
    """Load pretrained weights into ``model`` safely and report exactly what happened.

    Args:
        model: the module to fill (typically a backbone).
        checkpoint: path, URL or scheme accepted by :func:`safe_load`, or an already-loaded
            checkpoint dict.
        prefix: see :func:`strip_prefixes` (``None`` auto-detects mmpretrain/mmdet ``backbone.``
            files, unless the model itself has ``backbone.`` keys).
        map_location, allow_unsafe_pickle: see :func:`safe_load`.
        prefer_ema: use EMA weights (``model_ema``/``state_dict_ema``) when present.
        strict: raise when any model key is missing or any checkpoint key is unexpected (checked
            before anything is copied into the model).
        min_loaded: the share of the model's parameter values (elements) the checkpoint must
            supply; below it the load is refused before anything is copied (a file of another
            model, or with another code base's key names, matches only a few norms). 0 loads
            whatever matches. Default 0.5.
        logger: where the summary goes, via ``mmengine.logging.print_log`` (WARNING level when
            keys are missing/unexpected, INFO otherwise); ``None`` means mmengine's current logger.

    Pipeline: :func:`safe_load` -> :func:`extract_state_dict` -> :func:`strip_prefixes` ->
    ``model.convert_pretrained_state_dict(sd)`` (if defined) -> drop keys matching
    ``model.pretrained_ignore_keys`` and :data:`DEFAULT_IGNORE_BUFFER_KEYS`, and
    :data:`DEFAULT_HEAD_KEYS` unless the model has them with the same shape -> for shape
    mismatches, ``resize_checkpoint_tensor`` of the module owning the key ->
    ``model.load_state_dict(strict=False)``.

    Raises:
        CheckpointError: nothing matches the model; less than ``min_loaded`` of it does; a shape
            mismatch its module does not resize; ``strict`` violations; plus everything
            :func:`safe_load` raises.
    """
    name = _ckpt_name(checkpoint)
    ckpt = _load_any(checkpoint, map_location, allow_unsafe_pickle)
    sd, source, non_tensor = unwrap_checkpoint(ckpt, prefer_ema)
    report = LoadReport(source=source, non_tensor=non_tensor, checkpoint=name)

    model_keys = model.state_dict().keys()
    if prefix is None and any(k.startswith('backbone.') for k in model_keys):
        prefix = ''  # the model itself is a full detector/classifier: no auto-strip
    sd, dropped = strip_prefixes(sd, prefix)
    report.dropped.update(dropped)

    matched, model_state, ignore = _apply_model_pipeline(model, sd, report, name)
    report.missing = [k for k in model_state
                      if k not in matched and not any(rx.search(k) for rx in ignore)]
    report.loaded = list(matched)

    _check_share_loaded(model, matched, report, name, min_loaded)
    if strict and (report.missing or report.unexpected):
        raise CheckpointError(
            f"strict loading of '{name}' into {type(model).__name__} failed: "
            f'{len(report.missing)} missing key(s) {format_keys(report.missing, 20)}; '
            f'{len(report.unexpected)} unexpected key(s) {format_keys(report.unexpected, 20)}')

    result = model.load_state_dict(matched, strict=False)
    leftover = [k for k in result.unexpected_keys]
    if leftover:  # cannot happen (we only pass model keys) - but never hide it
        report.unexpected.extend(k for k in leftover if k not in report.unexpected)

    from mmengine.logging import print_log
    level = logging.WARNING if (report.missing or report.unexpected) else logging.INFO
    print_log(report.summary(), logger='current' if logger is None else logger, level=level)
    return report


def _check_share_loaded(model, matched, report, name, min_loaded):
    """Refuse a load that would fill less than ``min_loaded`` of the model's parameter values."""
    if not isinstance(min_loaded, (int, float)) or not 0 <= min_loaded <= 1:
        raise CheckpointError(f'min_loaded must be a number in [0, 1], got {min_loaded!r}')
    sizes = {k: p.numel() for k, p in model.named_parameters()}
    total = sum(sizes.values())
    if not total:
        return
    share = sum(n for k, n in sizes.items() if k in matched) / total
    if share >= min_loaded:
        return
    missing = [k for k in sizes if k not in matched]
    if report.unexpected:
        why = (f'{len(report.unexpected)} checkpoint key(s) match nothing, e.g. '
               f'{format_keys(report.unexpected, 4)}: it looks like the file of another model, or '
               f"with another code base's key names (rename them in "
               f'{type(model).__name__}.convert_pretrained_state_dict, or convert the file first)')
    else:
        why = ('every key of the file matches, but it holds only part of the model (a backbone\'s '
               'file for a whole detector? load it into the backbone, through its init_cfg)')
    raise CheckpointError(
        f"checkpoint '{name}' would fill only {share:.1%} of {type(model).__name__}'s parameter "
        f'values ({sum(k in matched for k in sizes)} of {len(sizes)} parameters; '
        f'min_loaded={min_loaded}; missing, e.g. {format_keys(missing, 4)}). {why}. To load what '
        f"matches anyway, pass min_loaded=0 (in an init_cfg: dict(type='Pretrained', "
        f'checkpoint=..., min_loaded=0)).')


def _plain_tensor(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if type(t) is not torch.Tensor:
        t = t.as_subclass(torch.Tensor)
    t = t.contiguous()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone()  # do not save the whole storage of a view
    return t


def convert_checkpoint(src, dst, prefix: str = 'backbone.',
                       allow_unsafe_pickle: Optional[bool] = None, prefer_ema: bool = True,
                       model: Optional[torch.nn.Module] = None) -> LoadReport:
    """Convert an official checkpoint offline into a tensors-only mmengine-style file.

    Steps: :func:`safe_load` (same opt-in policy) -> :func:`extract_state_dict` ->
    :func:`strip_prefixes` (auto ``module.``/``backbone.`` handling) -> drop classifier heads
    (:data:`DEFAULT_HEAD_KEYS`). With ``model`` the state dict additionally goes through the same
    hook / ignore / resize / validation steps as :func:`load_pretrained` (nothing is loaded; keys
    the model lacks are reported as unexpected and not written).

    The output ``{'state_dict': {prefix + key: tensor}, 'meta': {'converted_from': basename,
    'source_key': ...}}`` holds only plain tensors and strings, so it loads with
    ``torch.load(weights_only=True)`` without any allow-list, e.g. through stock mmengine
    ``init_cfg=dict(type='Pretrained', checkpoint=dst, prefix='backbone.')``.

    Returns:
        a :class:`LoadReport` (``loaded`` = keys written, without ``prefix``).
    """
    name = _ckpt_name(src)
    ckpt = _load_any(src, 'cpu', allow_unsafe_pickle)
    sd, source, non_tensor = unwrap_checkpoint(ckpt, prefer_ema)
    report = LoadReport(source=source, non_tensor=non_tensor, checkpoint=name)
    sd, dropped = strip_prefixes(sd, None)
    report.dropped.update(dropped)
    if model is not None:
        out, model_state, ignore = _apply_model_pipeline(model, sd, report, name)
        report.missing = [k for k in model_state
                          if k not in out and not any(rx.search(k) for rx in ignore)]
    else:
        heads = [re.compile(p) for p in DEFAULT_HEAD_KEYS]
        out = collections.OrderedDict()
        for k, v in sd.items():
            if any(rx.search(k) for rx in heads):
                report.dropped[k] = 'classifier head of the source model'
            else:
                out[k] = v
    if not out:
        raise CheckpointError(f"nothing left to write from '{name}' after dropping heads")
    report.loaded = list(out)
    state = {f'{prefix}{k}': _plain_tensor(v) for k, v in out.items()}
    meta = {'converted_from': os.path.basename(name), 'source_key': str(source)}
    dst = os.fspath(dst)
    parent = os.path.dirname(os.path.abspath(dst))
    os.makedirs(parent, exist_ok=True)
    tmp = dst + '.tmp'
    torch.save({'state_dict': state, 'meta': meta}, tmp)
    os.replace(tmp, dst)
    return report
