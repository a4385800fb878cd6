"""tools/learning_check.py on a reduced budget (2 iterations): every run finishes, the section it
writes into the fidelity page parses (one row per run, metrics within their ranges, the untrained
row first), an existing page keeps its other content, and the loss-curve PNG and the JSON are
written. The real budget is a benchmark (docs/fidelity.md), not a test."""
import json
import re
import runpy

import numpy as np
from PIL import Image

TOOL = runpy.run_path('tools/learning_check.py', run_name='learning_check')


def test_default_runs_put_every_mixer_into_the_nat_skeleton():
    specs = TOOL['runs_of']('det', ['polaformer', 'nalaformer', 'padre', 'poly', 'setformer'])
    assert [s[0] for s in specs] == ['softmax', 'polaformer', 'nalaformer', 'padre', 'poly',
                                     'setformer']
    assert {s[1] for s in specs} == {'configs/setformer/mask-rcnn_setformer-t_fpn_1x_coco.py'}
    types = [s[2]['attn_cfg']['type'] for s in specs]
    assert types == ['GlobalSoftmaxAttention', 'PolaLinearAttention', 'NormAwareLinearAttention',
                     'PADReMixer', 'PolySelfAttention', 'SeTAttention']
    assert all(s[2]['attn_cfg']['_delete_'] for s in specs)  # the config's SeT options go
    seg = TOOL['runs_of']('seg', ['nalaformer'])
    assert [s[0] for s in seg] == ['softmax', 'nalaformer']
    assert seg[0][1].endswith('upernet_setformer-t_8xb2-160k_ade20k-512x512.py')
    text = TOOL['recipe_text'](specs[1][1], 'det', 300, 1e-3, specs[1][2])
    assert ("attn_cfg=dict(_delete_=True, type='PolaLinearAttention', qkv_layout='qkvg', "
            "alpha=4, kernel_size=5)") in text
    assert 'embed_dims=32, depths=[1, 1, 2, 1]' in text  # the tiny NAT arch


def test_own_skeleton_runs_pair_each_family_with_its_softmax_skeleton():
    det = TOOL['runs_of']('det', ['polaformer', 'nalaformer', 'padre'], 'own')
    names = [s[0] for s in det]
    assert names == ['softmax', 'nalaformer-softmax', 'polaformer', 'nalaformer', 'padre']
    nala_soft = dict((s[0], s) for s in det)['nalaformer-softmax']
    assert nala_soft[1].endswith('mask-rcnn_nalaformer-t_fpn_1x_coco.py')
    assert nala_soft[2] == dict(attn_cfg=dict(type='NaLaSoftmaxAttention'))
    assert det[0][1] == 'configs/swin/mask-rcnn_swin-t_fpn_1x_coco.py'
    seg = TOOL['runs_of']('seg', ['setformer'], 'own')
    assert [s[0] for s in seg] == ['setformer-softmax', 'setformer']
    assert seg[0][2]['attn_cfg']['type'] == 'GlobalSoftmaxAttention'
    text = TOOL['recipe_text'](det[0][1], 'det', 300, 2e-4)
    assert "max_iters=300" in text and 'T_max=270' in text and 'out_channels=64' in text


def test_reduced_learning_check_writes_a_parsable_section(tmp_path):
    out = tmp_path / 'fidelity.md'
    out.write_text('# Fidelity report\n\nkept text\n')
    plot, js = tmp_path / 'curves.png', tmp_path / 'runs.json'
    results = TOOL['main'](['--task', 'det', 'seg', '--only', 'polaformer', '--iters', '2',
                            '--workers', '2', '--work-dir', str(tmp_path / 'work'), '--out',
                            str(out), '--plot', str(plot), '--json', str(js)])
    assert len(results) == 6  # per task: untrained, softmax skeleton, PolaFormer
    text = out.read_text()
    assert text.startswith('# Fidelity report\n\nkept text\n')
    assert '## Learning check on the demo data' in text and '--iters 2' in text
    rows = re.findall(r'^\| ([\w ()-]+?) \| `(configs/[\w/.-]+)` \((\w+)\) \| ([\d.| ]+?) \| '
                      r'([\d.—]+) \| (\d+) \|$', text, re.M)
    assert len(rows) == 6, text
    det, seg = rows[:3], rows[3:]
    assert det[0][0].startswith('softmax (untrained') and seg[0][0].startswith(
        'softmax (untrained')
    # after 2 iterations a detector may still find nothing: the row then says so
    assert [r[0].replace(' (no detections)', '') for r in det[1:]] == ['softmax', 'polaformer']
    assert [r[0] for r in seg[1:]] == ['softmax', 'polaformer']
    # every run is the NAT skeleton with the mixer named in its row
    assert {r[1] for r in det} == {'configs/setformer/mask-rcnn_setformer-t_fpn_1x_coco.py'}
    assert [r[2] for r in seg] == ['GlobalSoftmaxAttention'] * 2 + ['PolaLinearAttention']
    assert '| coco/bbox_mAP | coco/bbox_mAP_50 | coco/segm_mAP | coco/segm_mAP_50 |' in text
    assert '| mIoU | mAcc | aAcc |' in text
    for r in det:
        vals = [float(v) for v in r[3].split(' | ')]
        assert len(vals) == 4 and all(0.0 <= v <= 1.0 for v in vals)  # COCO AP
    for r in seg:
        vals = [float(v) for v in r[3].split(' | ')]
        assert len(vals) == 3 and all(0.0 <= v <= 100.0 for v in vals)  # percent
    for r in det[1:] + seg[1:]:
        assert float(r[4]) > 0  # the last logged training loss
    data = json.loads(js.read_text())
    trained = [d for d in data if not d['untrained']]
    assert all(len(d['losses']) >= 1 and d['losses'][-1][0] == 2 for d in trained)
    img = np.asarray(Image.open(plot))
    assert img.shape[0] > 100 and img.shape[1] > 200 and img.std() > 1
    # --reuse takes the finished runs (same recipe) instead of training again
    again = TOOL['main'](['--task', 'det', '--only', 'polaformer', '--iters', '2', '--reuse',
                          '--work-dir', str(tmp_path / 'work'), '--out', str(out), '--plot',
                          str(plot)])
    assert [r['metrics'] for r in again] == [r['metrics'] for r in results[:3]]
    assert [r['seconds'] for r in again] == [r['seconds'] for r in results[:3]]


def test_main_demo_config_is_the_learning_checks_pola_run(tmp_path):
    """tools/demo.sh trains the learning check's PolaFormer Mask R-CNN (same model, optimiser,
    schedule and data; docs/fidelity.md has its AP): the two cannot drift apart. Both run through
    the demo overlay."""
    from harness import demo_form
    spec = dict((s[0], s) for s in TOOL['runs_of']('det', ['polaformer']))['polaformer']
    path = tmp_path / 'learning_check_pola.py'
    path.write_text(TOOL['recipe_text'](spec[1], 'det', 300, TOOL['DEFAULT_LR']['det'], spec[2]))
    check = demo_form(str(path))
    demo = demo_form('configs/polaformer/mask-rcnn_pola-nat-tiny_fpn_300it_coco.py')
    for key in ('model', 'optim_wrapper', 'param_scheduler', 'train_cfg', 'train_dataloader',
                'val_dataloader', 'val_evaluator', 'log_processor'):
        assert check[key] == demo[key], key
    assert demo.model.backbone.attn_cfg.type == 'PolaLinearAttention'
    assert "CONFIG=\"${1:-configs/polaformer/mask-rcnn_pola-nat-tiny_fpn_300it_coco.py}\"" \
        in open('tools/demo.sh').read()
