"""Official checkpoint formats load into the skeletons through init_cfg=Pretrained, with
size-dependent tensors resized and everything else reported."""
import pytest
import torch
import torch.nn.functional as F

from linattn_mm.checkpoint import CheckpointError
from linattn_mm.models.backbones import LinAttnPVT, LinAttnSwin, LinAttnViT


def pretrained(path, **kw):
    return dict(init_cfg=dict(type='Pretrained', checkpoint=str(path)), **kw)


def test_official_swin_file(tmp_path):
    """Official Swin layout: {'model': ..., 'config': CfgNode-like}, a final 'norm', buffers
    relative_position_index / attn_mask, and a classifier head."""
    torch.manual_seed(0)
    ref = LinAttnSwin(arch='t', out_indices=(3, ))
    sd = {k: torch.randn_like(v) for k, v in ref.state_dict().items()}
    official = {('norm.' + k[6:] if k.startswith('norm3.') else k): v for k, v in sd.items()}
    official['layers.0.blocks.0.attn.relative_position_index'] = torch.zeros(49, 49).long()
    official['layers.0.blocks.1.attn_mask'] = torch.zeros(64, 49, 49)
    official['head.weight'] = torch.randn(1000, 768)
    official['head.bias'] = torch.randn(1000)
    torch.save({'model': official, 'epoch': 299, 'max_accuracy': 81.2}, tmp_path / 'swin.pth')

    m = LinAttnSwin(arch='t', **pretrained(tmp_path / 'swin.pth'))
    m.init_weights()
    got = m.state_dict()
    for k, v in sd.items():
        torch.testing.assert_close(got[k], v)
    rep = m.pretrained_load_report
    assert set(rep.missing) == {f'norm{i}.{p}' for i in range(3) for p in ('weight', 'bias')}
    assert not rep.unexpected
    assert {'head.weight', 'head.bias'} <= set(rep.dropped)


def test_swin_relative_position_bias_resized_for_a_larger_window(tmp_path):
    arch = dict(embed_dims=16, depths=[2, 2, 2, 2], num_heads=[1, 2, 2, 4])
    src = LinAttnSwin(arch=arch)
    torch.save(src.state_dict(), tmp_path / 'w7.pth')
    m = LinAttnSwin(arch=arch, attn_cfg=dict(type='WindowSoftmaxAttention', window_size=12),
                    **pretrained(tmp_path / 'w7.pth'))
    m.init_weights()
    key = 'layers.1.blocks.0.attn.relative_position_bias_table'
    table = src.state_dict()[key]  # (13*13, 2)
    want = F.interpolate(table.T.reshape(1, 2, 13, 13), size=(23, 23), mode='bicubic',
                         align_corners=False).reshape(2, -1).T
    torch.testing.assert_close(m.state_dict()[key], want)
    assert key in m.pretrained_load_report.resized


def test_official_pvt_file_with_class_token(tmp_path):
    """Official PVT v1: pos_embed4 carries the class token row, plus cls_token/norm/head."""
    ref = LinAttnPVT(arch='t')
    sd = {k: torch.randn_like(v) for k, v in ref.state_dict().items()}
    official = dict(sd)
    official['pos_embed4'] = torch.cat([torch.randn(1, 1, 512), sd['pos_embed4']], 1)
    official['cls_token'] = torch.randn(1, 1, 512)
    official['norm.weight'] = torch.ones(512)
    official['norm.bias'] = torch.zeros(512)
    official['head.weight'] = torch.randn(1000, 512)
    torch.save(official, tmp_path / 'pvt_tiny.pth')  # raw state dict
    m = LinAttnPVT(arch='t', **pretrained(tmp_path / 'pvt_tiny.pth'))
    m.init_weights()
    torch.testing.assert_close(m.state_dict()['pos_embed4'], sd['pos_embed4'])
    torch.testing.assert_close(m.state_dict()['block2.1.attn.sr.weight'], sd['block2.1.attn.sr.weight'])
    rep = m.pretrained_load_report
    assert not rep.missing and not rep.unexpected
    assert {'cls_token', 'norm.weight', 'head.weight'} <= set(rep.dropped)


def test_deit_pos_embed_resized_to_another_pretrain_size(tmp_path):
    src = LinAttnViT(arch='t', out_type='cls_token')
    torch.save({'model': src.state_dict()}, tmp_path / 'deit.pth')
    m = LinAttnViT(arch='t', pretrain_img_size=384, out_type='cls_token',
                   **pretrained(tmp_path / 'deit.pth'))
    m.init_weights()
    pe = src.state_dict()['pos_embed']
    grid = pe[:, 1:].reshape(1, 14, 14, 192).permute(0, 3, 1, 2)
    want = F.interpolate(grid, size=(24, 24), mode='bicubic', align_corners=False)
    want = torch.cat([pe[:, :1], want.flatten(2).transpose(1, 2)], 1)
    torch.testing.assert_close(m.state_dict()['pos_embed'], want)
    torch.testing.assert_close(m.state_dict()['cls_token'], src.state_dict()['cls_token'])


def test_mmpretrain_format_with_backbone_prefix(tmp_path):
    src = LinAttnPVT(arch='t')
    sd = {'backbone.' + k: v + 1 for k, v in src.state_dict().items()}
    sd['head.fc.weight'] = torch.randn(1000, 512)
    torch.save({'state_dict': sd, 'meta': {'epoch': 1}}, tmp_path / 'mmpretrain.pth')
    for prefix in (None, 'backbone.'):
        m = LinAttnPVT(arch='t', init_cfg=dict(type='Pretrained', prefix=prefix,
                                               checkpoint=str(tmp_path / 'mmpretrain.pth')))
        m.init_weights()
        torch.testing.assert_close(m.state_dict()['block1.0.attn.q.weight'],
                                   src.state_dict()['block1.0.attn.q.weight'] + 1)


def test_wrong_architecture_and_misshaped_tensors_are_errors(tmp_path):
    torch.save({'model': LinAttnSwin(arch='t').state_dict()}, tmp_path / 'swin.pth')
    with pytest.raises(CheckpointError, match='matches none'):
        LinAttnPVT(arch='t', **pretrained(tmp_path / 'swin.pth')).init_weights()
    sd = LinAttnPVT(arch='t').state_dict()
    sd['block1.0.attn.q.weight'] = torch.randn(32, 64)
    torch.save(sd, tmp_path / 'bad.pth')
    with pytest.raises(CheckpointError, match=r'block1\.0\.attn\.q\.weight'):
        LinAttnPVT(arch='t', **pretrained(tmp_path / 'bad.pth')).init_weights()
    with pytest.raises(KeyError, match='unknown Pretrained init_cfg option'):
        LinAttnPVT(arch='t', init_cfg=dict(type='Pretrained', checkpoint='x.pth',
                                           weights_only=False)).init_weights()


class _Evil:

    def __reduce__(self):
        return (print, ('code ran',))


def test_pickled_code_needs_opt_in(tmp_path):
    sd = LinAttnPVT(arch='t').state_dict()
    torch.save({'model': sd, 'args': _Evil()}, tmp_path / 'evil.pth')
    with pytest.raises(CheckpointError, match='allow_unsafe_pickle'):
        LinAttnPVT(arch='t', **pretrained(tmp_path / 'evil.pth')).init_weights()
    m = LinAttnPVT(arch='t', init_cfg=dict(type='Pretrained', allow_unsafe_pickle=True,
                                           checkpoint=str(tmp_path / 'evil.pth')))
    with pytest.warns(UserWarning):
        m.init_weights()
    assert not m.pretrained_load_report.missing


def test_convert_checkpoint_tool(tmp_path):
    """tools/convert_checkpoint.py turns an official file into a tensors-only mmpretrain-style
    file that the stock mmengine prefix loader and our backbones both accept."""
    from harness import run_python
    src = LinAttnPVT(arch='t')
    official = {k: v + 2 for k, v in src.state_dict().items()}
    official['head.weight'] = torch.randn(1000, 512)
    torch.save({'model': official, 'args': __import__('argparse').Namespace(lr=1e-3)},
               tmp_path / 'pvt.pth')
    res = run_python(['tools/convert_checkpoint.py', str(tmp_path / 'pvt.pth'),
                      str(tmp_path / 'out.pth'), '--model', 'pvt-t_in1k'])
    assert res.returncode == 0, res.stderr[-3000:]
    # the report, without mmengine's per-parameter init log (about 950 lines for this model)
    assert len(res.stdout.splitlines()) <= 6 and 'Initialized by' not in res.stdout, \
        res.stdout[:2000]
    assert "'model'): 156 loaded, 0 resized, 0 missing, 0 unexpected, 1 dropped" in res.stdout
    out = torch.load(tmp_path / 'out.pth', weights_only=True)
    keys = set(out['state_dict'])
    assert all(k.startswith('backbone.') for k in keys) and 'backbone.head.weight' not in keys
    from mmengine.runner.checkpoint import _load_checkpoint_with_prefix
    stock = _load_checkpoint_with_prefix('backbone.', str(tmp_path / 'out.pth'))
    torch.testing.assert_close(stock['pos_embed1'], official['pos_embed1'])
    m = LinAttnPVT(arch='t', init_cfg=dict(type='Pretrained', prefix='backbone.',
                                           checkpoint=str(tmp_path / 'out.pth')))
    m.init_weights()
    torch.testing.assert_close(m.state_dict()['block3.1.mlp.fc2.weight'],
                               official['block3.1.mlp.fc2.weight'])
    res = run_python(['tools/convert_checkpoint.py', str(tmp_path / 'no.pth'),
                      str(tmp_path / 'out2.pth')])
    assert res.returncode == 1 and 'Traceback' not in res.stderr
    assert f"error: no checkpoint file '{tmp_path / 'no.pth'}'" in res.stderr


def test_pvt_pos_embed_resized_as_the_forward_resizes_it(tmp_path):
    """PVT resizes its position tables bilinearly to the input in the forward; the load resizes a
    checkpoint's tables from another pretraining size the same way, so the loaded model at its own
    size gives the checkpoint model's outputs there (a bicubic load differed by up to 10 %)."""
    arch = dict(embed_dims=[16, 16, 32, 32], depths=[1, 1, 1, 1], num_heads=[1, 1, 2, 2],
                mlp_ratios=[2, 2, 2, 2], sr_ratios=[8, 4, 2, 1])
    torch.manual_seed(0)
    src = LinAttnPVT(arch=arch, pretrain_img_size=256).double().eval()
    with torch.no_grad():
        for i in range(1, 5):
            getattr(src, f'pos_embed{i}').normal_()
    torch.save(src.state_dict(), tmp_path / 'pvt256.pth')
    m = LinAttnPVT(arch=arch, pretrain_img_size=224, **pretrained(tmp_path / 'pvt256.pth'))
    m.double().init_weights()
    m.eval()
    assert 'pos_embed1' in m.pretrained_load_report.resized
    assert 'bilinear' in m.pretrained_load_report.notes['pos_embed1']
    x = torch.randn(1, 3, 224, 224, dtype=torch.float64)
    with torch.no_grad():
        for got, want in zip(m(x), src(x)):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_a_file_that_fills_little_of_the_model_is_refused(tmp_path):
    """A file with another code base's key names (here mmpretrain's Swin: ``stages.*`` for
    ``layers.*``) matches only the norms outside the stages: the load is refused before anything
    is copied, the error gives the share and how to load anyway; ``min_loaded=0`` loads what
    matches."""
    torch.manual_seed(0)
    arch = dict(embed_dims=16, depths=[1, 1, 1, 1], num_heads=[1, 1, 2, 2])
    sd = {k.replace('layers.', 'stages.', 1): torch.randn_like(v)
          for k, v in LinAttnSwin(arch=arch).state_dict().items()}
    torch.save({'state_dict': {'backbone.' + k: v for k, v in sd.items()}}, tmp_path / 'mmp.pth')
    m = LinAttnSwin(arch=arch, **pretrained(tmp_path / 'mmp.pth'))
    with pytest.raises(CheckpointError, match=r'fill only \d+\.\d% .*stages\.0\.blocks.*'
                                              r'min_loaded=0'):
        m.init_weights()
    after = m.state_dict()
    matching = [k for k in sd if k in after]  # the norms outside the stages
    assert matching and not any(torch.equal(after[k], sd[k]) for k in matching)
    m = LinAttnSwin(arch=arch, init_cfg=dict(type='Pretrained', min_loaded=0,
                                             checkpoint=str(tmp_path / 'mmp.pth')))
    m.init_weights()
    torch.testing.assert_close(m.state_dict()['patch_embed.norm.weight'],
                               sd['patch_embed.norm.weight'])
    assert m.pretrained_load_report.missing and m.pretrained_load_report.unexpected
