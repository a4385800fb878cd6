"""Registration in mmpretrain / mmdet / mmseg, ops-free model code, and the Python API."""
import importlib.abc
import subprocess
import sys

import pytest
import torch

import linattn_mm
from linattn_mm.registry import registered_backbones

BACKBONES = ['LinAttnPVT', 'LinAttnPVTv2', 'LinAttnSwin', 'LinAttnViT', 'PolyNLResNet',
             'SeTformer']
SMALL = dict(LinAttnPVT=dict(arch='t'), LinAttnPVTv2=dict(arch='b0'),
             LinAttnSwin=dict(arch=dict(embed_dims=16, depths=[1, 1, 1, 1],
                                        num_heads=[1, 2, 2, 4])),
             LinAttnViT=dict(arch=dict(embed_dims=32, depth=4, num_heads=2)),
             PolyNLResNet=dict(depth=50),
             SeTformer=dict(arch=dict(embed_dims=16, depths=[1, 1, 1, 1], num_heads=[1, 2, 2, 4],
                                      mlp_ratio=2), attn_cfg=dict(type='SeTAttention', num_refs=8)))


def test_every_backbone_is_registered_once():
    names = [c.__name__ for c in registered_backbones()]
    assert set(BACKBONES) <= set(names)
    assert len(names) == len(set(names))


@pytest.mark.parametrize('lib', ['mmpretrain', 'mmdet', 'mmseg'])
@pytest.mark.parametrize('name', BACKBONES)
def test_build_through_each_registry(lib, name):
    import importlib
    registry = importlib.import_module(f'{lib}.registry').MODELS
    assert registry.get(name) is linattn_mm.MODELS.get(name)
    m = registry.build(dict(type=name, **SMALL[name])).eval()
    outs = m(torch.randn(1, 3, 64, 64))
    assert len(outs) == 4 and all(o.dim() == 4 for o in outs)


def test_stock_names_are_not_overridden():
    from mmdet.registry import MODELS as DET
    from mmseg.registry import MODELS as SEG
    assert DET.get('SwinTransformer').__module__.startswith('mmdet')
    assert SEG.get('SwinTransformer').__module__.startswith('mmseg')
    assert DET.get('PyramidVisionTransformer').__module__.startswith('mmdet')


def test_register_downstream_is_idempotent_and_refuses_clashes():
    from mmengine.registry import Registry

    from linattn_mm import registry as reg
    assert reg.register_downstream() == ['mmpretrain', 'mmdet', 'mmseg']
    # a foreign class already registered under one of our names is an error, not an override
    fake = Registry('model')

    class LinAttnSwin:  # noqa: N801 - same name, other class
        pass

    fake.register_module(module=LinAttnSwin)
    orig = dict(reg.DOWNSTREAM_REGISTRIES)
    import importlib.machinery
    import types
    mod = types.ModuleType('_linattn_fake_registry')
    mod.__spec__ = importlib.machinery.ModuleSpec('_linattn_fake_registry', None)
    mod.MODELS = fake
    sys.modules['_linattn_fake_registry'] = mod
    reg.DOWNSTREAM_REGISTRIES['fake'] = '_linattn_fake_registry'
    try:
        with pytest.raises(KeyError, match='already registered'):
            reg.register_downstream(['fake'])
    finally:
        reg.DOWNSTREAM_REGISTRIES.clear()
        reg.DOWNSTREAM_REGISTRIES.update(orig)
        del sys.modules['_linattn_fake_registry']


def test_a_library_that_fails_its_version_check_is_skipped_with_a_warning():
    """mmdet 3.3 / mmseg 1.2 *assert* their mmcv version on import (AssertionError, not
    ImportError): with a rejected mmcv installed, the other registries are still filled and the
    one that failed is named in a warning, instead of ``import linattn_mm`` failing."""
    import importlib.machinery
    import types

    from linattn_mm import registry as reg
    mod = types.ModuleType('_linattn_bad_version')
    mod.__spec__ = importlib.machinery.ModuleSpec('_linattn_bad_version', None)
    mod.__path__ = []  # a package, so its submodule is looked up by the finders
    sys.modules['_linattn_bad_version'] = mod
    finder_name = '_linattn_bad_version.registry'

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == finder_name:
                raise AssertionError('MMCV==2.2.0 is used but incompatible. Please install '
                                     'mmcv>=2.0.0rc4, <2.2.0.')
            return None

    finder = Finder()
    sys.meta_path.insert(0, finder)
    orig = dict(reg.DOWNSTREAM_REGISTRIES)
    reg.DOWNSTREAM_REGISTRIES['baddet'] = finder_name
    try:
        with pytest.warns(UserWarning, match=r'baddet is not importable \(AssertionError: '
                                             r'MMCV==2\.2\.0 is used but incompatible'):
            done = reg.register_downstream()
        assert done == ['mmpretrain', 'mmdet', 'mmseg']
    finally:
        sys.meta_path.remove(finder)
        reg.DOWNSTREAM_REGISTRIES.clear()
        reg.DOWNSTREAM_REGISTRIES.update(orig)
        del sys.modules['_linattn_bad_version']


def test_model_code_imports_without_compiled_ops():
    """Block mmcv's compiled extension (and mmdet/mmseg) and use the model code anyway."""
    code = (
        'import sys\n'
        "for name in ('mmcv._ext', 'mmcv.ops', 'mmdet', 'mmseg', 'mmpretrain'):\n"
        '    sys.modules[name] = None\n'
        'import torch\n'
        'from linattn_mm.models.backbones import LinAttnSwin, LinAttnPVTv2\n'
        "m = LinAttnPVTv2(arch='b0').eval()\n"
        'outs = m(torch.randn(1, 3, 64, 64))\n'
        "assert [o.shape[1] for o in outs] == [32, 64, 160, 256]\n"
        "assert 'mmcv._ext' not in sys.modules or sys.modules['mmcv._ext'] is None\n"
        "print('ok')\n")
    res = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip().endswith('ok')


def test_list_models():
    names = linattn_mm.list_models()
    assert 'swin-t_in1k' in names and 'mask-rcnn_pvtv2-b0_fpn_1x_coco' in names
    assert not linattn_mm.list_models('*_demo')  # demo forms come from the overlay, not files
    assert linattn_mm.list_models('upernet_*') == sorted(
        n for n in names if n.startswith('upernet_'))
    from linattn_mm.apis import _zoo
    # each baseline skeleton: ImageNet + five heads (Mask R-CNN 1x and 3x), all of which the
    # demo overlay trains on the demo data (tests/e2e/test_all_demo_configs.py)
    for skeleton in ('swin', 'pvt', 'pvtv2', 'deit'):
        configs = [n for n in names if _zoo()[n].split('/')[-2] == skeleton]
        dense = [n for n in configs if not n.endswith('_in1k')]
        assert len(dense) == 6 and any(n.endswith('_in1k') for n in configs), (skeleton, configs)


def test_get_model_classifier_and_errors():
    m = linattn_mm.get_model('swin-t_in1k')
    assert type(m).__name__ == 'ImageClassifier' and type(m.backbone).__name__ == 'LinAttnSwin'
    out = m(torch.randn(1, 3, 64, 64), mode='tensor')
    assert out.shape == (1, 1000)
    m = linattn_mm.get_model('deit-t_in1k', backbone=dict(drop_path_rate=0.0))
    assert m.backbone.blocks[-1].drop_path.drop_prob == 0.0
    with pytest.raises(KeyError, match="unknown model 'swin-x_in1k'"):
        linattn_mm.get_model('swin-x_in1k')


def test_get_model_classifier_normalises_as_the_config_says():
    """mmpretrain configs hold ``data_preprocessor`` (mean, std, BGR to RGB) at the top level:
    the model of ``get_model`` normalises with it, as the runner's and ``init_model``'s do."""
    cfg = linattn_mm.apis.get_config('pola-pvt-t_in1k')
    pre = cfg.data_preprocessor
    m = linattn_mm.get_model('pola-pvt-t_in1k', convert=False)
    img = torch.randint(0, 256, (3, 40, 48), dtype=torch.uint8)
    got = m.data_preprocessor(dict(inputs=[img]), False)['inputs']
    mean = torch.tensor(pre.mean).view(3, 1, 1)
    std = torch.tensor(pre.std).view(3, 1, 1)
    assert pre.to_rgb
    want = (img.flip(0).float() - mean) / std  # BGR file order to RGB, then normalised
    torch.testing.assert_close(got[0], want)


def test_get_model_pretrained_official_file(tmp_path):
    """An official-format file ({'model': ...} with backbone keys and 'head.weight/bias') gives an
    mmpretrain classifier computing exactly the official function: GAP of the last stage, then
    the official linear head."""
    src = linattn_mm.get_model('pvtv2-b0_in1k')
    torch.manual_seed(0)
    official = {k[len('backbone.'):]: v.clone() + 0.01 * torch.randn_like(v.float()).to(v.dtype)
                for k, v in src.state_dict().items() if k.startswith('backbone.')}
    official['head.weight'] = torch.randn(1000, 256)
    official['head.bias'] = torch.randn(1000)
    path = tmp_path / 'pvt_v2_b0.pth'
    torch.save({'model': official, 'epoch': 300}, path)
    m = linattn_mm.get_model('pvtv2-b0_in1k', pretrained=str(path))
    for k, v in m.backbone.state_dict().items():
        torch.testing.assert_close(v, official[k])
    assert 'head.weight' not in m.load_report.dropped
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        feat = m.backbone(x)[-1].mean((2, 3))
        want = feat @ official['head.weight'].T + official['head.bias']
        torch.testing.assert_close(m(x, mode='tensor'), want, rtol=1e-4, atol=1e-4)


def test_unknown_model_names_say_what_is_close():
    """A zoo name written with underscores finds its hyphenated twin; a path that is no file says
    so instead of calling it an unknown model."""
    from linattn_mm.apis import get_config
    with pytest.raises(KeyError, match=r"unknown model 'swin_t_in1k'; \d+ models are available.*"
                                       r"similar: \['swin-t_in1k'"):
        get_config('swin_t_in1k')
    with pytest.raises(FileNotFoundError, match=r"no config file 'configs/nosuch\.py'"):
        get_config('configs/nosuch.py')


def test_get_model_fills_a_detectors_backbone_from_a_classifiers_file(tmp_path):
    """An mmpretrain classifier's file (``backbone.*`` and ``head.*``) given to a detector fills
    its backbone (the backbone is less than half of a Mask R-CNN's parameters: loading the file
    into the whole detector would be refused); a whole detector's file still loads whole."""
    import torch

    from linattn_mm import get_model
    cls = get_model('pola-pvt-t_in1k', convert=False)
    sd = {k: torch.randn_like(v) if v.is_floating_point() else v
          for k, v in cls.state_dict().items()}
    torch.save({'state_dict': sd, 'meta': {}}, tmp_path / 'cls.pth')
    det = get_model('mask-rcnn_pola-pvt-t_fpn_1x_coco', pretrained=str(tmp_path / 'cls.pth'),
                    convert=False)
    got = det.backbone.state_dict()
    for k in ('block1.0.attn.qg.weight', 'pos_embed2', 'block4.1.mlp.fc2.bias'):
        key = next(n for n in got if n.endswith(k))
        torch.testing.assert_close(got[key], sd['backbone.' + key])
    assert not det.load_report.missing
    torch.save({'state_dict': det.state_dict()}, tmp_path / 'det.pth')
    again = get_model('mask-rcnn_pola-pvt-t_fpn_1x_coco', pretrained=str(tmp_path / 'det.pth'),
                      convert=False)
    assert set(again.load_report.loaded) == set(det.state_dict())


def test_the_tools_module_names_the_shipped_tools_and_refuses_others(capsys, monkeypatch):
    """``python -m linattn_mm.tools`` / ``linattn-mm``: the tools it runs are the files setup.py
    ships as ``.mim/tools``; in a checkout they come from ``tools/``; a wrong name is refused with
    the list, and ``train --help`` is the train tool's own help."""
    import os.path as osp
    import runpy

    import setuptools

    from linattn_mm import tools
    repo = osp.dirname(osp.dirname(osp.abspath(linattn_mm.__file__)))
    monkeypatch.setattr(setuptools, 'setup', lambda **kwargs: None)  # setup.py's definitions only
    shipped = runpy.run_path(osp.join(repo, 'setup.py'))['shipped_tools']()
    assert sorted(shipped) == sorted([f'{n}.py' for n in tools.TOOLS] + list(tools.LAUNCHERS))
    assert all(osp.isfile(osp.join(repo, 'tools', name)) for name in shipped)
    assert tools.tools_dir() == osp.join(repo, 'tools')
    assert tools.tool_path('test.py') == osp.join(repo, 'tools', 'test.py')
    with pytest.raises(ValueError, match=r"no tool named 'learning_check'; the tools are train, "
                                         r"test, benchmark"):
        tools.tool_path('learning_check')
    assert tools.main(['trian', 'x.py']) == 2
    err = capsys.readouterr().err
    assert "no tool named 'trian'" in err and 'usage: python -m linattn_mm.tools TOOL' in err
    assert tools.main([]) == 2 and 'make_demo_data' in capsys.readouterr().err
    monkeypatch.setattr(sys, 'argv', list(sys.argv))
    with pytest.raises(SystemExit) as done:
        tools.main(['train', '--help'])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith('usage: train.py') and '--attn-core' in out and '--demo' in out
