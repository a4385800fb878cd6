"""Segmentors with every family's backbone: whole-image and sliding-window inference both work on
an odd-sized image, and sliding with one window covering the image gives exactly the whole-image
logits (the windows are stitched back without seams or double counting)."""
import pytest
import torch
from harness import demo_form

import linattn_mm  # noqa: F401

CONFIGS = [
    'configs/swin/fpn_swin-t_8xb4-40k_ade20k-512x512.py',
    'configs/polaformer/fpn_pola-pvt-t_8xb4-40k_ade20k-512x512.py',
    'configs/nalaformer/fpn_nalaformer-t_8xb4-40k_ade20k-512x512.py',
    'configs/padre/fpn_padre-swin-t_8xb4-40k_ade20k-512x512.py',
    'configs/poly/fpn_poly-swin-t_8xb4-40k_ade20k-512x512.py',
    'configs/setformer/fpn_setformer-t_8xb4-40k_ade20k-512x512.py',
]


def build(config, test_cfg):
    """The segmentor of ``config`` in its demo form (the demo overlay: e.g. 64 SeT references)."""
    from mmengine.registry import MODELS, init_default_scope
    cfg = demo_form(config)
    init_default_scope('mmseg')
    cfg.model.backbone.init_cfg = None
    cfg.model.test_cfg = test_cfg
    torch.manual_seed(0)
    return MODELS.build(cfg.model).eval()


def seg_logits(model, img):
    from mmseg.structures import SegDataSample
    H, W = img.shape[-2:]
    sample = SegDataSample(metainfo=dict(img_shape=(H, W), ori_shape=(H, W), pad_shape=(H, W)))
    with torch.no_grad():
        out = model.predict(img, [sample])[0]
    return out.seg_logits.data, out.pred_sem_seg.data


@pytest.mark.parametrize('config', CONFIGS, ids=lambda c: c.split('/')[1])
def test_whole_and_slide_inference(config):
    img = torch.randn(1, 3, 97, 131)
    whole = build(config, dict(mode='whole'))
    logits_w, pred_w = seg_logits(whole, img)
    assert logits_w.shape[-2:] == (97, 131) and pred_w.shape == (1, 97, 131)
    assert torch.isfinite(logits_w).all()
    one = build(config, dict(mode='slide', crop_size=(128, 160), stride=(96, 128)))
    one.load_state_dict(whole.state_dict())
    torch.testing.assert_close(seg_logits(one, img)[0], logits_w, rtol=1e-5, atol=1e-5)
    many = build(config, dict(mode='slide', crop_size=(64, 64), stride=(48, 48)))
    many.load_state_dict(whole.state_dict())
    logits_s, pred_s = seg_logits(many, img)
    assert logits_s.shape == logits_w.shape and pred_s.shape == (1, 97, 131)
    assert torch.isfinite(logits_s).all()
