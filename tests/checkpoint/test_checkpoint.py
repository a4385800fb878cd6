"""Tests of linattn_mm.checkpoint: safe loading, the scoped allow-list, unwrapping, resizing through
the owning module's resize_checkpoint_tensor, reporting, conversion."""
import argparse
import logging
import subprocess
import sys
import types

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from linattn_mm import checkpoint as ck
from linattn_mm.checkpoint import (CheckpointError, LoadReport, SafeGlobalsHook,
                                   UnsafePickleWarning, allow_safe_globals, convert_checkpoint,
                                   extract_state_dict, load_pretrained, resize_grid_tokens,
                                   resize_pos_embed, resize_relative_position_table, safe_globals,
                                   safe_load, strip_prefixes)
from linattn_mm.checkpoint import allowlist

DIM = 8


# ----------------------------------------------------------------------------------------------
# tiny models: each module resizes its own size-dependent tensor, as the model families do
# ----------------------------------------------------------------------------------------------
class TinyAttn(nn.Module):
    def __init__(self, window, heads):
        super().__init__()
        self.relative_position_bias_table = nn.Parameter(torch.zeros((2 * window - 1) ** 2, heads))
        idx = torch.arange(window * window)
        self.register_buffer('relative_position_index', idx[:, None] - idx[None, :])

    def resize_checkpoint_tensor(self, name, src):  # as WindowSoftmaxAttention
        if name != 'relative_position_bias_table':
            return None
        return resize_relative_position_table(name, src, self.relative_position_bias_table.shape)


class TinyBlock(nn.Module):
    def __init__(self, window, heads, pe_grid):
        super().__init__()
        self.attn = TinyAttn(window, heads)
        self.positional_encoding = nn.Parameter(torch.zeros(1, pe_grid * pe_grid, DIM))

    def resize_checkpoint_tensor(self, name, src):  # as PolaLinearAttention
        if name != 'positional_encoding':
            return None
        return resize_grid_tokens(name, src, self.positional_encoding.shape, max_extra=0)


class Tiny(nn.Module):
    def __init__(self, grid=4, extra=1, window=3, heads=2, pe_grid=4):
        super().__init__()
        self.pos_embed = nn.Parameter(torch.zeros(1, extra + grid * grid, DIM))
        self.layers = nn.ModuleList([TinyBlock(window, heads, pe_grid)])
        self.proj = nn.Linear(DIM, DIM)

    def resize_checkpoint_tensor(self, name, src):  # as the ViT / PVT / Swin backbones
        if name != 'pos_embed':
            return None
        return resize_pos_embed(name, src, self.pos_embed.shape)


class AbsPosEmbed4d(nn.Module):
    """A (1, C, H, W) absolute position embedding (Swin-style layout)."""

    def __init__(self, h, w):
        super().__init__()
        self.absolute_pos_embed = nn.Parameter(torch.zeros(1, DIM, h, w))

    def resize_checkpoint_tensor(self, name, src):
        return resize_pos_embed(name, src, self.absolute_pos_embed.shape)


def random_sd(model, seed=0):
    """Random values for every float tensor of ``model`` (integer buffers kept as they are)."""
    g = torch.Generator().manual_seed(seed)
    return {k: (torch.randn(v.shape, generator=g) if v.is_floating_point() else v.clone())
            for k, v in model.state_dict().items()}


def float_items(sd):
    return {k: v for k, v in sd.items() if v.is_floating_point()}


def assert_loaded(model, sd):
    msd = model.state_dict()
    for k, v in float_items(sd).items():
        assert torch.equal(msd[k], v), k


def save(obj, path):
    torch.save(obj, path)
    return str(path)


QUIET = logging.getLogger('linattn_test_quiet')
QUIET.addHandler(logging.NullHandler())
QUIET.propagate = False


# ----------------------------------------------------------------------------------------------
# formats
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize('layout', ['model', 'model_ema', 'state_dict_backbone', 'module', 'raw'])
def test_formats_load_exact_values(tmp_path, layout):
    model = Tiny()
    sd = random_sd(model, 1)
    ema = random_sd(model, 2)
    expected, source = sd, layout
    if layout == 'model':
        ckpt = {'model': {**sd, 'head.weight': torch.randn(10, DIM)},
                'optimizer': {'state': {}, 'param_groups': []}, 'epoch': 3,
                'max_accuracy': torch.tensor(81.2)}
    elif layout == 'model_ema':
        ckpt = {'model': sd, 'model_ema': ema, 'epoch': 299}
        expected = ema
    elif layout == 'state_dict_backbone':
        ckpt = {'state_dict': {**{'backbone.' + k: v for k, v in sd.items()},
                               'head.fc.weight': torch.randn(10, DIM),
                               'neck.gap.weight': torch.randn(3),
                               'data_preprocessor.mean': torch.randn(3)},
                'meta': {'epoch': 1, 'dataset_meta': {'classes': ('a', 'b')}}}
    elif layout == 'module':
        ckpt = {'state_dict': {'module.' + k: v for k, v in sd.items()}}
        source = 'state_dict'
    else:
        ckpt = dict(sd)
    path = save(ckpt, tmp_path / 'ckpt.pth')
    report = load_pretrained(model, path, logger=QUIET)
    assert_loaded(model, expected)
    assert report.source == {'state_dict_backbone': 'state_dict'}.get(layout, source)
    assert report.missing == [] and report.unexpected == []
    assert report.dropped.get('layers.0.attn.relative_position_index') == 'recomputed buffer'
    assert set(report.loaded) == set(float_items(sd))
    if layout == 'model':
        assert 'classifier head' in report.dropped['head.weight']
    if layout == 'state_dict_backbone':
        for k in ('head.fc.weight', 'neck.gap.weight', 'data_preprocessor.mean'):
            assert 'not part of the backbone' in report.dropped[k]
    if layout == 'model_ema':  # and the non-EMA weights on request
        load_pretrained(model, path, prefer_ema=False, logger=QUIET)
        assert_loaded(model, sd)


def test_in_memory_dict_and_extract_helpers():
    model = Tiny()
    sd = random_sd(model, 3)
    report = load_pretrained(model, {'state_dict': sd}, logger=QUIET)
    assert report.checkpoint == '<in-memory dict>'
    assert_loaded(model, sd)
    with pytest.warns(UserWarning, match='steps'):
        out, source = extract_state_dict({'model_ema': {'a': torch.ones(1), 'steps': 7},
                                          'model': {'a': torch.zeros(1)}})
    assert source == 'model_ema' and list(out) == ['a'] and out['a'].item() == 1
    out, source = extract_state_dict({'model_ema': {'a': torch.ones(1)},
                                      'model': {'a': torch.zeros(1)}}, prefer_ema=False)
    assert source == 'model' and out['a'].item() == 0
    with pytest.raises(CheckpointError, match="'epoch'.*'config'|'config'.*'epoch'"):
        extract_state_dict({'epoch': 3, 'config': {'lr': 0.1}})


def test_strip_prefixes():
    t = torch.zeros(1)
    out, dropped = strip_prefixes({'module.module.a': t, 'module.b': t})
    assert list(out) == ['a', 'b'] and dropped == {}
    out, dropped = strip_prefixes({'backbone.a': t, 'head.w': t, 'neck.x': t})
    assert list(out) == ['a'] and set(dropped) == {'head.w', 'neck.x'}
    out, dropped = strip_prefixes({'encoder.a': t, 'decoder.b': t}, prefix='encoder.')
    assert list(out) == ['a'] and list(dropped) == ['decoder.b']
    with pytest.raises(CheckpointError, match="prefix 'backbone.'.*'encoder.a'"):
        strip_prefixes({'encoder.a': t}, prefix='backbone.')


# ----------------------------------------------------------------------------------------------
# resizing
# ----------------------------------------------------------------------------------------------
def grid_interp(tokens, src_side, dst_side):
    """Independent reference: (1, s*s, C) -> (1, t*t, C) bicubic, align_corners=False."""
    c = tokens.shape[-1]
    grid = tokens.reshape(1, src_side, src_side, c).permute(0, 3, 1, 2)
    out = F.interpolate(grid, size=(dst_side, dst_side), mode='bicubic', align_corners=False)
    return out.permute(0, 2, 3, 1).reshape(1, dst_side * dst_side, c)


def test_pos_embed_resized_with_class_token():
    src_model, model = Tiny(grid=4), Tiny(grid=6)
    sd = random_sd(src_model, 4)
    report = load_pretrained(model, {'model': sd}, logger=QUIET)
    got = model.pos_embed.detach()
    src = sd['pos_embed']
    assert got.shape == (1, 37, DIM)
    assert torch.equal(got[:, :1], src[:, :1])  # class token row preserved
    torch.testing.assert_close(got[:, 1:], grid_interp(src[:, 1:], 4, 6), rtol=0, atol=1e-6)
    assert report.resized['pos_embed'] == ((1, 17, DIM), (1, 37, DIM))
    assert 'pos_embed' in report.summary() and '(1, 17, 8) -> (1, 37, 8)' in report.summary()


def test_pos_embed_class_token_dropped_and_reported():
    sd = random_sd(Tiny(grid=4, extra=1), 5)
    model = Tiny(grid=4, extra=0)
    report = load_pretrained(model, sd, logger=QUIET)
    assert torch.equal(model.pos_embed.detach(), sd['pos_embed'][:, 1:])
    assert report.resized['pos_embed'] == ((1, 17, DIM), (1, 16, DIM))
    assert 'dropped 1 extra token' in report.notes['pos_embed']
    assert 'dropped 1 extra token' in report.summary()


def test_pos_embed_4d_and_positional_encoding():
    src = torch.randn(1, DIM, 4, 4)
    model = AbsPosEmbed4d(6, 5)
    report = load_pretrained(model, {'absolute_pos_embed': src}, logger=QUIET)
    ref = F.interpolate(src, size=(6, 5), mode='bicubic', align_corners=False)
    torch.testing.assert_close(model.absolute_pos_embed.detach(), ref, rtol=0, atol=0)
    assert report.resized['absolute_pos_embed'] == ((1, DIM, 4, 4), (1, DIM, 6, 5))

    sd = random_sd(Tiny(pe_grid=4), 6)
    model = Tiny(pe_grid=3)
    report = load_pretrained(model, sd, logger=QUIET)
    ref = grid_interp(sd['layers.0.positional_encoding'], 4, 3)
    torch.testing.assert_close(model.layers[0].positional_encoding.detach(), ref, rtol=0,
                               atol=1e-6)
    assert report.resized['layers.0.positional_encoding'] == ((1, 16, DIM), (1, 9, DIM))
    bad = dict(random_sd(Tiny(pe_grid=3), 6), **{'layers.0.positional_encoding':
                                                   torch.randn(1, 17, DIM)})
    with pytest.raises(CheckpointError, match='not a square') as info:
        load_pretrained(Tiny(pe_grid=3), bad, logger=QUIET)
    assert 'layers.0.positional_encoding' in str(info.value)


def test_pola_positional_encoding_resized_by_its_module():
    from linattn_mm.models.attentions.pola import PolaLinearAttention
    src = PolaLinearAttention(DIM, 2, pretrain_hw=(4, 4))
    sd = random_sd(src, 19)
    model = PolaLinearAttention(DIM, 2, pretrain_hw=(3, 3))
    report = load_pretrained(model, sd, strict=True, logger=QUIET)
    ref = grid_interp(sd['positional_encoding'], 4, 3)
    torch.testing.assert_close(model.positional_encoding.detach(), ref, rtol=0, atol=1e-6)
    assert report.resized['positional_encoding'] == ((1, 16, DIM), (1, 9, DIM))
    assert model.resize_checkpoint_tensor('power', sd['power']) is None  # not its business


def test_relative_position_bias_table_resize_per_head():
    sd = random_sd(Tiny(window=3), 7)  # (5*5, 2)
    model = Tiny(window=5)  # (9*9, 2)
    report = load_pretrained(model, sd, logger=QUIET)
    key = 'layers.0.attn.relative_position_bias_table'
    src, got = sd[key], model.state_dict()[key]
    assert got.shape == (81, 2)
    for h in range(2):
        ref = F.interpolate(src[:, h].reshape(1, 1, 5, 5), size=(9, 9), mode='bicubic',
                            align_corners=False).reshape(81)
        torch.testing.assert_close(got[:, h], ref, rtol=0, atol=1e-6)
    assert report.resized[key] == ((25, 2), (81, 2))
    # the window-size dependent index buffer is recomputed by the model, never loaded
    assert key.replace('bias_table', 'index') not in report.missing


def test_relative_position_bias_table_head_mismatch():
    sd = random_sd(Tiny(heads=3), 8)
    model = Tiny(heads=2)
    before = model.pos_embed.detach().clone()
    with pytest.raises(CheckpointError, match='heads'):
        load_pretrained(model, sd, logger=QUIET)
    assert torch.equal(model.pos_embed.detach(), before)  # nothing loaded


def test_shape_mismatch_without_resizer():
    model = Tiny()
    sd = random_sd(model, 9)
    sd['proj.weight'] = torch.randn(4, DIM)
    with pytest.raises(CheckpointError) as info:
        load_pretrained(model, sd, logger=QUIET)
    msg = str(info.value)
    assert 'proj.weight' in msg and '(4, 8)' in msg and '(8, 8)' in msg


class WithTable(nn.Module):
    """A custom module resizing its own table; records the names it was asked about."""

    def __init__(self, n, result='repeat'):
        super().__init__()
        self.my_custom_table = nn.Parameter(torch.zeros(n))
        self.result = result
        self.calls = []

    def resize_checkpoint_tensor(self, name, src):
        self.calls.append(name)
        if self.result == 'decline' or name != 'my_custom_table':
            return None
        if self.result == 'wrong_shape':
            return src, 'unchanged'
        return src.repeat(self.my_custom_table.shape[0] // src.shape[0]), 'repeated'


def test_custom_module_resizes_its_own_tensor():
    model = WithTable(4)
    report = load_pretrained(model, {'my_custom_table': torch.tensor([1., 2.])}, logger=QUIET)
    assert model.my_custom_table.tolist() == [1., 2., 1., 2.]
    assert report.notes['my_custom_table'] == 'repeated'
    assert model.calls == ['my_custom_table']

    # a nested module is asked with the name local to it
    outer = nn.Module()
    outer.inner = WithTable(6)
    report = load_pretrained(outer, {'inner.my_custom_table': torch.tensor([1., 2.])},
                             logger=QUIET)
    assert outer.inner.my_custom_table.tolist() == [1., 2.] * 3
    assert report.resized['inner.my_custom_table'] == ((2,), (6,))
    assert outer.inner.calls == ['my_custom_table']


def test_resize_method_declining_or_returning_a_wrong_shape_is_an_error():
    outer = nn.Module()
    outer.inner = WithTable(4, result='decline')
    with pytest.raises(CheckpointError, match="'inner.my_custom_table'.*WithTable") as info:
        load_pretrained(outer, {'inner.my_custom_table': torch.ones(2)}, logger=QUIET)
    assert '(2,)' in str(info.value) and '(4,)' in str(info.value)
    assert 'resize_checkpoint_tensor' in str(info.value)
    outer.inner = WithTable(4, result='wrong_shape')
    with pytest.raises(CheckpointError, match=r"WithTable.resize_checkpoint_tensor returned \(2,\) "
                       r"for 'inner.my_custom_table', expected \(4,\)"):
        load_pretrained(outer, {'inner.my_custom_table': torch.ones(2)}, logger=QUIET)
    assert torch.equal(outer.inner.my_custom_table.detach(), torch.zeros(4))  # nothing loaded


def test_model_hooks_rename_and_ignore():
    class Hooked(Tiny):
        pretrained_ignore_keys = (r'positional_encoding$',)

        def convert_pretrained_state_dict(self, sd):
            return {k.replace('old_proj.', 'proj.'): v for k, v in sd.items()}

    model = Hooked()
    sd = random_sd(Tiny(), 10)
    renamed = {k.replace('proj.', 'old_proj.'): v for k, v in sd.items()}
    before = model.layers[0].positional_encoding.detach().clone()
    report = load_pretrained(model, renamed, strict=True, logger=QUIET)
    assert torch.equal(model.proj.weight.detach(), sd['proj.weight'])
    assert torch.equal(model.layers[0].positional_encoding.detach(), before)
    assert 'pretrained_ignore_keys' in report.dropped['layers.0.positional_encoding']
    assert report.missing == []


# ----------------------------------------------------------------------------------------------
# mismatches and reporting
# ----------------------------------------------------------------------------------------------
def test_checkpoint_matching_nothing():
    model = Tiny()
    with pytest.raises(CheckpointError, match="matches none of the model's") as info:
        load_pretrained(model, {'encoder.blocks.0.w': torch.zeros(2)}, logger=QUIET)
    assert 'encoder.blocks.0.w' in str(info.value) and 'pos_embed' in str(info.value)
    assert 'prefix' in str(info.value)


def test_strict_missing_key_raises_and_loads_nothing():
    model = Tiny()
    sd = random_sd(model, 11)
    del sd['proj.bias']
    before = model.pos_embed.detach().clone()
    with pytest.raises(CheckpointError, match='proj.bias'):
        load_pretrained(model, sd, strict=True, logger=QUIET)
    assert torch.equal(model.pos_embed.detach(), before)


def test_missing_and_unexpected_reported_and_logged(caplog):
    model = Tiny()
    sd = random_sd(model, 12)
    del sd['proj.bias']
    sd['extra.weight'] = torch.randn(3)
    logger = logging.getLogger('linattn_test_report')
    with caplog.at_level(logging.INFO, logger='linattn_test_report'):
        report = load_pretrained(model, sd, logger=logger)
    assert isinstance(report, LoadReport)
    assert report.missing == ['proj.bias'] and report.unexpected == ['extra.weight']
    assert_loaded(model, {k: v for k, v in sd.items() if k != 'extra.weight'})
    warnings_logged = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings_logged) == 1
    text = warnings_logged[0].getMessage()
    assert 'proj.bias' in text and 'extra.weight' in text and '1 missing' in text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger='linattn_test_report'):
        load_pretrained(model, random_sd(model, 13), logger=logger)
    assert [r.levelno for r in caplog.records] == [logging.INFO]


# ----------------------------------------------------------------------------------------------
# safe loading
# ----------------------------------------------------------------------------------------------
def test_truncated_and_missing_file(tmp_path):
    path = save({'model': random_sd(Tiny(), 14)}, tmp_path / 'full.pth')
    data = open(path, 'rb').read()
    cut = tmp_path / 'cut.pth'
    cut.write_bytes(data[:len(data) // 2])
    with pytest.raises(CheckpointError, match='truncated') as info:
        safe_load(str(cut))
    assert 'cut.pth' in str(info.value) and f'{len(data) // 2} bytes' in str(info.value)
    with pytest.raises(CheckpointError, match='truncated'):
        load_pretrained(Tiny(), str(cut), logger=QUIET)
    with pytest.raises(FileNotFoundError, match='nope.pth'):
        safe_load(str(tmp_path / 'nope.pth'))


def _write_marker(path):
    """Stands for any code a malicious pickle could run."""
    with open(path, 'w') as f:
        f.write('pwned')
    return 'payload ran'


class Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return _write_marker, (self.marker,)


def test_code_running_pickle_is_refused(tmp_path, monkeypatch):
    monkeypatch.delenv(ck.UNSAFE_PICKLE_ENV, raising=False)
    marker = tmp_path / 'marker.txt'
    sd = random_sd(Tiny(), 15)
    path = save({'model': sd, 'payload': Evil(str(marker))}, tmp_path / 'evil.pth')
    glob = f'{_write_marker.__module__}._write_marker'
    with pytest.raises(CheckpointError) as info:
        safe_load(path)
    msg = str(info.value)
    assert glob in msg and 'allow_unsafe_pickle=True' in msg and ck.UNSAFE_PICKLE_ENV in msg
    assert 'evil.pth' in msg
    with pytest.raises(CheckpointError, match='_write_marker'):
        load_pretrained(Tiny(), path, logger=QUIET)
    monkeypatch.setenv(ck.UNSAFE_PICKLE_ENV, '1')
    with pytest.raises(CheckpointError):  # an explicit False beats the environment
        safe_load(path, allow_unsafe_pickle=False)
    assert not marker.exists()

    # documented opt-in: the file is trusted, so its pickle runs
    monkeypatch.delenv(ck.UNSAFE_PICKLE_ENV)
    with pytest.warns(UnsafePickleWarning):
        ckpt = safe_load(path, allow_unsafe_pickle=True)
    assert ckpt['payload'] == 'payload ran' and marker.exists()
    marker.unlink()
    monkeypatch.setenv(ck.UNSAFE_PICKLE_ENV, '1')
    model = Tiny()
    with pytest.warns(UnsafePickleWarning):
        load_pretrained(model, path, logger=QUIET)
    assert marker.exists()
    assert_loaded(model, sd)


def test_openmmlab_names_resolve_with_mmengine_tables():
    from mmengine.runner.checkpoint import get_external_models
    from linattn_mm.checkpoint import resolve_model_url
    urls = get_external_models()
    assert resolve_model_url('open-mmlab://resnet50_v1c') == urls['resnet50_v1c']
    # deprecated names map to their successors, as in mmengine's own loader
    assert resolve_model_url('openmmlab://resnet50_caffe') == urls['detectron/resnet50_caffe']
    assert resolve_model_url('mmcls://resnet50').startswith('https://download.openmmlab.com/')
    with pytest.raises(CheckpointError, match="unknown open-mmlab model 'nope'"):
        resolve_model_url('open-mmlab://nope')


def test_registered_scheme_goes_through_checkpoint_loader(tmp_path, monkeypatch):
    """A scheme registered with mmengine's CheckpointLoader (s3://, pavi://, a project's own) is
    read by its loader (a plain torch.load) under the same policy: harmless objects load, code
    does not run."""
    from mmengine.runner.checkpoint import CheckpointLoader
    monkeypatch.delenv(ck.UNSAFE_PICKLE_ENV, raising=False)
    monkeypatch.setattr(CheckpointLoader, '_schemes', dict(CheckpointLoader._schemes))
    seen = []

    @CheckpointLoader.register_scheme(prefixes='linattn-test://')
    def load_from_test_store(filename, map_location=None):
        seen.append(filename)
        return torch.load(tmp_path / filename[len('linattn-test://'):], map_location=map_location)

    runner_checkpoint(tmp_path / 'epoch_1.pth')
    assert_history_buffer(safe_load('linattn-test://epoch_1.pth'))
    assert seen == ['linattn-test://epoch_1.pth']
    marker = tmp_path / 'marker.txt'
    save({'model': random_sd(Tiny(), 20), 'payload': Evil(str(marker))}, tmp_path / 'evil.pth')
    with pytest.raises(CheckpointError, match='_write_marker') as info:
        safe_load('linattn-test://evil.pth')
    assert 'linattn-test://evil.pth' in str(info.value)
    with pytest.raises(CheckpointError, match='local files and http'):
        safe_load('linattn-test://evil.pth', allow_unsafe_pickle=True)
    assert not marker.exists()


@pytest.fixture
def fake_yacs(monkeypatch):
    """A throwaway ``yacs.config`` module with a CfgNode dict subclass (like the real one)."""
    yacs = types.ModuleType('yacs')
    config = types.ModuleType('yacs.config')

    class CfgNode(dict):
        def __init__(self, init=None):
            super().__init__(init or {})
            self.__dict__['__immutable__'] = False
            self.__dict__['__new_allowed__'] = False

    CfgNode.__module__ = 'yacs.config'
    CfgNode.__qualname__ = 'CfgNode'
    config.CfgNode = CfgNode
    yacs.config = config
    monkeypatch.setitem(sys.modules, 'yacs', yacs)
    monkeypatch.setitem(sys.modules, 'yacs.config', config)

    def remove():
        monkeypatch.delitem(sys.modules, 'yacs.config')
        monkeypatch.delitem(sys.modules, 'yacs')

    return CfgNode, remove


def test_harmless_objects_load_without_opt_in(tmp_path, monkeypatch, fake_yacs):
    monkeypatch.delenv(ck.UNSAFE_PICKLE_ENV, raising=False)
    CfgNode, remove_yacs = fake_yacs
    cfg = CfgNode({'MODEL': CfgNode({'TYPE': 'polaformer', 'DEPTHS': [2, 2, 6, 2]}),
                   'TRAIN': CfgNode({'BASE_LR': 5e-4})})
    sd = random_sd(Tiny(), 16)
    ckpt = {'model': sd, 'config': cfg, 'epoch': 299,
            'args': argparse.Namespace(model='deit_tiny', lr=5e-4, input_size=224),
            'np_array': np.arange(6, dtype=np.float32).reshape(2, 3),
            'np_int': np.arange(3), 'np_scalar': np.float64(81.5), 'np_i64': np.int64(7)}
    path = save(ckpt, tmp_path / 'swin_like.pth')
    remove_yacs()
    assert 'yacs.config' not in sys.modules
    out = safe_load(path)
    assert out['config']['MODEL']['TYPE'] == 'polaformer'
    assert out['config']['MODEL']['DEPTHS'] == [2, 2, 6, 2]
    assert out['config']['TRAIN']['BASE_LR'] == 5e-4
    assert out['args'].model == 'deit_tiny' and out['args'].input_size == 224
    np.testing.assert_array_equal(out['np_array'], np.arange(6, dtype=np.float32).reshape(2, 3))
    np.testing.assert_array_equal(out['np_int'], np.arange(3))
    assert out['np_scalar'] == 81.5 and out['np_i64'] == 7
    model = Tiny()
    report = load_pretrained(model, path, logger=QUIET)
    assert report.source == 'model'
    assert_loaded(model, sd)
    # legacy (pre-1.6, non-zip) serialization goes through the same allow-list
    legacy = tmp_path / 'legacy.pth'
    torch.save({k: v for k, v in ckpt.items() if k != 'config'}, legacy,
               _use_new_zipfile_serialization=False)
    out = safe_load(str(legacy))
    assert out['args'].lr == 5e-4 and out['np_scalar'] == 81.5
    assert torch.equal(out['model']['pos_embed'], sd['pos_embed'])


@pytest.fixture
def restore_allow_list():
    """torch's allow-list (and the process-wide flag) as before the test."""
    saved, flag = torch.serialization.get_safe_globals(), allowlist._process_wide
    yield
    torch.serialization.clear_safe_globals()
    torch.serialization.add_safe_globals(saved)
    allowlist._process_wide = flag


def runner_checkpoint(path):
    """An mmengine runner checkpoint: a message hub with a HistoryBuffer, numpy values."""
    from mmengine.logging import MessageHub
    hub = MessageHub.get_instance(f'linattn_ckpt_test_{path}')  # a fresh hub per file
    for i in range(3):
        hub.update_scalar('train/loss', 1.0 / (i + 1))
    hub.update_info('iter', 3)
    ckpt = {'meta': {'epoch': 1, 'iter': 3, 'seed': 0, 'mmengine_version': '0.10.7',
                     'cfg': "model = dict(type='X')"},
            'state_dict': random_sd(Tiny(), 17), 'message_hub': hub.state_dict(),
            'optimizer': {'state': {}, 'param_groups': [{'lr': 0.1, 'params': [0, 1]}]}}
    return save(ckpt, path)


def assert_history_buffer(loaded):
    from mmengine.logging import HistoryBuffer
    buf = loaded['message_hub']['log_scalars']['train/loss']
    assert isinstance(buf, HistoryBuffer)
    np.testing.assert_allclose(buf.data[0], [1.0, 0.5, 1.0 / 3])
    assert buf.current() == pytest.approx(1.0 / 3)
    assert buf.statistics('min') == pytest.approx(1.0 / 3)


def test_mmengine_runner_checkpoint_resumable_with_plain_torch_load(tmp_path, restore_allow_list):
    path = runner_checkpoint(tmp_path / 'epoch_1.pth')
    allow_safe_globals()  # the explicit process-wide opt-in
    allow_safe_globals()  # idempotent
    loaded = torch.load(path)  # default weights_only=True, as mmengine's --resume calls it
    assert_history_buffer(loaded)
    with safe_globals():  # a scope inside the opt-in leaves it in force
        pass
    assert_history_buffer(torch.load(path))


def test_allow_list_is_scoped(tmp_path, restore_allow_list):
    path = runner_checkpoint(tmp_path / 'epoch_1.pth')
    before = set(torch.serialization.get_safe_globals())
    with pytest.raises(Exception, match='HistoryBuffer'):
        torch.load(path)  # outside a scope: torch's own policy refuses it
    with safe_globals():
        with safe_globals():  # nested scopes
            assert_history_buffer(torch.load(path))
        assert_history_buffer(torch.load(path))  # the inner exit keeps the outer scope
    assert set(torch.serialization.get_safe_globals()) == before
    with pytest.raises(Exception, match='HistoryBuffer'):
        torch.load(path)
    assert_history_buffer(safe_load(path))  # the loaders use the scope themselves
    assert set(torch.serialization.get_safe_globals()) == before


def test_safe_globals_hook_covers_the_runner_loading_only(tmp_path, restore_allow_list):
    """Runner.train/val/test call before_run, then load_or_resume, then the loop's
    before_train/val/test: the allow-list is in force in between, and only then."""
    path = runner_checkpoint(tmp_path / 'epoch_1.pth')
    before = set(torch.serialization.get_safe_globals())
    for leave in ('before_train', 'before_val', 'before_test', 'after_run'):
        hook = SafeGlobalsHook()
        hook.before_run(None)
        assert_history_buffer(torch.load(path))
        getattr(hook, leave)(None)
        assert set(torch.serialization.get_safe_globals()) == before
        with pytest.raises(Exception, match='HistoryBuffer'):
            torch.load(path)
    from mmdet.registry import HOOKS
    from mmengine.registry import DefaultScope
    with DefaultScope.overwrite_default_scope('mmdet'):  # as the configs name it
        assert isinstance(HOOKS.build(dict(type='linattn_mm.SafeGlobalsHook')), SafeGlobalsHook)


def test_importing_the_package_leaves_the_allow_list_alone():
    code = ('import torch, linattn_mm; from linattn_mm.checkpoint import SAFE_GLOBALS; '
            'added = set(SAFE_GLOBALS) & set(torch.serialization.get_safe_globals()); '
            'assert not added, added; print("none added")')
    res = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and 'none added' in res.stdout, res.stderr[-3000:]


class SneakyGetattr:
    """Pickles as ``getattr(numpy.ndarray, 'tofile')``: the allow-list's getattr stand-in must
    refuse it (only HistoryBuffer's own statistics functions may be fetched)."""

    def __reduce__(self):
        return getattr, (np.ndarray, 'tofile')


def test_restricted_getattr_refuses_other_attributes(tmp_path, restore_allow_list):
    path = save({'model': {'a': torch.ones(1)}, 'x': SneakyGetattr()}, tmp_path / 'g.pth')
    with pytest.raises(CheckpointError, match="getattr.*'ndarray'.*'tofile'.*not allowed"):
        safe_load(path, allow_unsafe_pickle=False)
    names = allow_safe_globals()
    for name in ('argparse.Namespace', 'yacs.config.CfgNode', 'numpy.core.multiarray._reconstruct',
                 'numpy._core.multiarray._reconstruct', 'numpy.core.multiarray.scalar',
                 'numpy.dtypes.Float64DType', 'mmengine.logging.history_buffer.HistoryBuffer'):
        assert name in names
    assert 'builtins.eval' not in names and 'numpy.dtypes.ObjectDType' not in names


class HugeBytes:
    """Pickles as ``bytes(10**12)``: a tiny file asking for a terabyte."""

    def __reduce__(self):
        return bytes, (10 ** 12, )


def test_empty_arrays_and_bytes_load_but_bytes_of_a_size_do_not(tmp_path, restore_allow_list):
    """Pickle protocol 2 writes b'' as the call ``bytes()``: empty numpy arrays (a fresh
    HistoryBuffer's history) and empty bytes load through the allow-list with their values;
    ``bytes(n)`` is refused."""
    from mmengine.logging import HistoryBuffer
    obj = {'model': {'a': torch.ones(1)}, 'e': np.zeros(0), 'i': np.array([], dtype=np.int64),
           'b': b'', 'nb': b'ab', 'hb': HistoryBuffer()}
    ckpt = safe_load(save(obj, tmp_path / 'e.pth'), allow_unsafe_pickle=False)
    assert ckpt['e'].shape == (0, ) and ckpt['e'].dtype == np.float64
    assert ckpt['i'].dtype == np.int64 and ckpt['b'] == b'' and ckpt['nb'] == b'ab'
    assert isinstance(ckpt['hb'], HistoryBuffer) and len(ckpt['hb'].data[0]) == 0
    path = save({'model': {'a': torch.ones(1)}, 'x': HugeBytes()}, tmp_path / 'h.pth')
    with pytest.raises(CheckpointError, match=r"bytes\(1000000000000,\) is not allowed"):
        safe_load(path, allow_unsafe_pickle=False)


# ----------------------------------------------------------------------------------------------
# conversion
# ----------------------------------------------------------------------------------------------
def _load_without_allow_list(path):
    saved = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    try:
        assert torch.serialization.get_unsafe_globals_in_checkpoint(path) == []
        return torch.load(path, weights_only=True)
    finally:
        torch.serialization.add_safe_globals(saved)


def test_convert_checkpoint_round_trip(tmp_path, fake_yacs):
    CfgNode, remove_yacs = fake_yacs
    sd = random_sd(Tiny(), 18)
    src = save({'model': {**sd, 'head.weight': torch.randn(10, DIM),
                          'head.bias': torch.randn(10)},
                'config': CfgNode({'MODEL': CfgNode({'TYPE': 'swin'})}),
                'args': argparse.Namespace(lr=1.0)}, tmp_path / 'official.pth')
    remove_yacs()
    dst = str(tmp_path / 'out' / 'converted.pth')
    report = convert_checkpoint(src, dst)
    assert set(report.loaded) == set(sd)
    assert 'classifier head' in report.dropped['head.weight']
    out = _load_without_allow_list(dst)
    assert set(out) == {'state_dict', 'meta'}
    assert out['meta'] == {'converted_from': 'official.pth', 'source_key': 'model'}
    assert all(k.startswith('backbone.') for k in out['state_dict'])
    assert all(type(v) is torch.Tensor for v in out['state_dict'].values())
    assert set(out['state_dict']) == {'backbone.' + k for k in sd}

    model = Tiny()
    load_pretrained(model, dst, prefix='backbone.', strict=True, logger=QUIET)
    assert_loaded(model, sd)

    # stock mmengine `Pretrained(prefix='backbone.')` path (plain torch.load inside)
    from mmengine.runner.checkpoint import _load_checkpoint_with_prefix
    saved = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    try:
        stock = _load_checkpoint_with_prefix('backbone.', dst)
    finally:
        torch.serialization.add_safe_globals(saved)
    assert torch.equal(stock['pos_embed'], sd['pos_embed'])

    # with a model: resized to its shapes at conversion time
    dst2 = str(tmp_path / 'converted_6x6.pth')
    report = convert_checkpoint(src, dst2, model=Tiny(grid=6))
    assert report.resized['pos_embed'] == ((1, 17, DIM), (1, 37, DIM))
    out2 = _load_without_allow_list(dst2)
    assert out2['state_dict']['backbone.pos_embed'].shape == (1, 37, DIM)
    assert 'backbone.layers.0.attn.relative_position_index' not in out2['state_dict']
