"""``tools/train.py --attn-core``: :func:`linattn_mm.cli.set_attention_core` puts every Pola and
NaLa mixer of a built model on the named core (windows and softmax stages untouched), the tool
trains with it, and models without such mixers, NaLa feature maps without a Triton core and
unknown core names are refused with the reason."""
import os.path as osp
import re

import pytest
from harness import CONFIGS, demo_form, run_tool, short_run_options
from mmengine.config import Config

import linattn_mm  # noqa: F401  (registers the backbones)
from linattn_mm.cli import set_attention_core
from linattn_mm.models.attentions.nala import NormAwareLinearAttention
from linattn_mm.models.attentions.pola import PolaLinearAttention
from linattn_mm.models.attentions.softmax import WindowSoftmaxAttention

TINY = dict(embed_dims=16, depths=[1, 1, 1, 1], num_heads=[1, 2, 2, 2])


def _backbone(rel, arch=TINY):
    from mmdet.registry import MODELS
    cfg = Config.fromfile(osp.join(CONFIGS, rel))
    return MODELS.build(dict(cfg.model.backbone, init_cfg=None, arch=arch))


@pytest.fixture
def triton_here(monkeypatch):
    """Triton's interpreter on: the Triton cores accept CPU tensors."""
    pytest.importorskip('triton')
    monkeypatch.setenv('TRITON_INTERPRET', '1')


def test_pola_swin_mixers_and_not_its_windows(triton_here):
    net = _backbone('polaformer/mask-rcnn_pola-swin-t_fpn_1x_coco.py')
    assert set_attention_core(net, 'triton') == 2  # global Pola stages 1-2
    pola = [m for m in net.modules() if isinstance(m, PolaLinearAttention)]
    assert [m.core for m in pola] == ['triton', 'triton']
    assert sum(isinstance(m, WindowSoftmaxAttention) for m in net.modules()) == 2
    assert set_attention_core(net, 'fast') == 2 and all(m.core == 'fast' for m in pola)


def test_nalaformer_released_layout_nala_stages(triton_here):
    net = _backbone('nalaformer/mask-rcnn_nalaformer-t_fpn_1x_coco.py', 'xt')
    nala = [m for m in net.modules() if isinstance(m, NormAwareLinearAttention)]
    assert len(nala) == 4  # NaLa stages 1-2 (depths 2, 2); softmax stages 3-4
    assert set_attention_core(net, 'triton') == 4 and all(m.core == 'triton' for m in nala)


def test_refusals_name_the_reason(monkeypatch):
    monkeypatch.delenv('TRITON_INTERPRET', raising=False)
    with pytest.raises(ValueError, match='the model is on cpu; the Triton kernels run on CUDA'):
        set_attention_core(_backbone('polaformer/mask-rcnn_pola-swin-t_fpn_1x_coco.py'), 'triton')
    monkeypatch.setenv('TRITON_INTERPRET', '1')
    with pytest.raises(ValueError, match='has no Pola or NaLa mixer'):
        set_attention_core(_backbone('swin/mask-rcnn_swin-t_fpn_1x_coco.py'), 'triton')
    with pytest.raises(ValueError, match='core must be one of'):
        set_attention_core(_backbone('polaformer/mask-rcnn_pola-swin-t_fpn_1x_coco.py'), 'cuda')
    net = _backbone('nalaformer/mask-rcnn_nalaformer-t_fpn_1x_coco.py', 'xt')
    paper = next(m for m in net.modules() if isinstance(m, NormAwareLinearAttention))
    paper.kernel = 'paper'
    with pytest.raises(ValueError,
                       match=r"layers\.0\.blocks\.0\.attn \(kernel='paper'.*has no Triton core"):
        set_attention_core(net, 'triton')
    assert all(m.core == 'fast' for m in net.modules()
               if isinstance(m, NormAwareLinearAttention)), 'nothing set when refused'


@pytest.mark.slow
def test_train_tool_runs_with_the_named_core(demo_data, tmp_path):
    # the reference core (plain autograd) through the tool on CPU: the option reaches the model
    cfg = osp.join(CONFIGS, 'polaformer/mask-rcnn_pola-pvt-t_fpn_1x_coco.py')
    train, _, _ = short_run_options(Config.fromfile(cfg))
    out = run_tool(['tools/train.py', cfg, '--demo', '--attn-core', 'reference', '--work-dir',
                    str(tmp_path / 'work'), '--cfg-options'] + train)
    assert "--attn-core: 8 Pola / NaLa mixers on core 'reference'" in out  # depths 2, 2, 2, 2
    assert 'Saving checkpoint' in out


@pytest.mark.slow
@pytest.mark.parametrize('config, mixers, blocks', [
    ('polaformer/mask-rcnn_pola-swin-t_fpn_1x_coco.py', 4, ''),  # global Pola stages 1-2
    # NaLa stages 1-2 (2 + 2 blocks); all 2 + 2 + 6 + 2 blocks with their fused conv sums and
    # their mixers (NaLa and softmax) with their fused gated output; the softmax mixers of stages
    # 3-4 (6 + 2) with their fused RoPE
    ('nalaformer/mask-rcnn_nalaformer-t_fpn_1x_coco.py', 4,
     ', 12 NaLaFormer blocks with fused conv sums, 12 NaLa mixers (softmax ones included) '
     'with fused gates, 8 softmax mixers with a fused RoPE')])
def test_train_tool_runs_with_the_fused_core(demo_data, tmp_path, config, mixers, blocks):
    # the fused cores (and NaLaFormer's fused conv sums and gates) through the tool: their Triton
    # kernels in the interpreter on CPU, one Mask R-CNN iteration with finite losses, on one
    # image resized to 64 pixels (the interpreter runs each kernel instance in numpy, and its time
    # grows with the tokens: at the demo's 160 pixels, two images took six minutes on 2 cores)
    pytest.importorskip('triton')
    cfg = osp.join(CONFIGS, config)
    train, _, _ = short_run_options(Config.fromfile(cfg))
    assert demo_form(cfg).train_dataloader.dataset.pipeline[2].type == 'Resize'
    train += ['train_dataloader.dataset.indices=1', 'train_dataloader.batch_size=1',
              'train_dataloader.dataset.pipeline.2.scale=(64,64)']
    out = run_tool(['tools/train.py', cfg, '--demo', '--attn-core', 'fused', '--work-dir',
                    str(tmp_path / 'work'), '--cfg-options'] + train,
                   env=dict(TRITON_INTERPRET='1'))
    assert f"--attn-core: {mixers} Pola / NaLa mixers on core 'fused'{blocks}\n" in out
    loss = re.search(r'Epoch\(train\) \[1\]\[1/1\].* loss: ([\d.]+) ', out)
    assert loss and 0 < float(loss.group(1)) < 100, out[-3000:]
    assert 'Saving checkpoint' in out
