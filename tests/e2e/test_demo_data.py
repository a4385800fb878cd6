"""Tests for linattn_mm.demo's data generator (synthetic COCO / ADE20K / ImageNet demo datasets)."""
import hashlib
import importlib
import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image, ImageDraw, ImageFilter

from linattn_mm.demo import COCO_SHAPE_COLOURS, STAMP_NAME, make_demo_data

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NUM_TRAIN, NUM_VAL = 4, 3

# Facts about the real datasets, written out here independently of the generator.
COCO_UNUSED_IDS = {12, 26, 29, 30, 45, 66, 68, 69, 71, 83}
COCO_USED = {37: 'sports ball', 38: 'kite', 72: 'tv'}
COCO_SOME_REAL = {1: 'person', 2: 'bicycle', 3: 'car', 13: 'stop sign', 27: 'backpack',
                  46: 'wine glass', 67: 'dining table', 84: 'book', 90: 'toothbrush'}
# dominant RGB channel of each used class
DOMINANT = {'sports ball': 0, 'kite': 1, 'tv': 2}
ADE_VALUES = {0, 1, 3, 4, 5, 21}
IMAGENET = {'n01440764': 0, 'n01443537': 1, 'n01484850': 2, 'n01491361': 3}


def _tree_hashes(root):
    out = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            full = os.path.join(dirpath, name)
            with open(full, 'rb') as f:
                out[os.path.relpath(full, root)] = hashlib.sha256(f.read()).hexdigest()
    return out


def _mask_from_polygon(flat, w, h, s=16):
    """COCO-convention mask (pixel centre inside the polygon), rasterised with PIL at s x scale.

    The generator stores vertices on a 1/16 px grid, so they are exact integers at s=16.
    """
    xs, ys = np.asarray(flat[0::2]), np.asarray(flat[1::2])
    assert np.allclose(xs * s, np.round(xs * s)) and np.allclose(ys * s, np.round(ys * s))
    # rasterise inside an integer-aligned window around the polygon (keeps the canvas small)
    left, top = int(xs.min()), int(ys.min())
    cw, ch = int(np.ceil(xs.max())) + 1 - left, int(np.ceil(ys.max())) + 1 - top
    canvas = Image.new('L', (cw * s, ch * s), 0)
    ImageDraw.Draw(canvas).polygon(
        [(int(round((x - left) * s)), int(round((y - top) * s))) for x, y in zip(xs, ys)], fill=1)
    mask = np.zeros((h, w), bool)
    window = np.asarray(canvas, dtype=bool)[s // 2::s, s // 2::s]
    mask[top:top + ch, left:left + cw] = window[:h - top, :w - left]
    return mask


def _import_or_skip(name):
    pytest.importorskip(name.split('.')[0])
    try:
        return importlib.import_module(name)
    except Exception as exc:  # e.g. mmcv missing / version assertion in mmdet's __init__
        pytest.skip(f'{name} not importable: {exc!r}')


@pytest.fixture(scope='module')
def demo(tmp_path_factory):
    root = tmp_path_factory.mktemp('demo')
    result = make_demo_data(str(root), seed=0, num_train=NUM_TRAIN, num_val=NUM_VAL, progress=False)
    return root, result


def _load_coco(root, split):
    with open(os.path.join(root, 'coco', 'annotations', f'instances_{split}2017.json')) as f:
        return json.load(f)


# ------------------------------------------------------------------------------------------
# determinism / idempotency
# ------------------------------------------------------------------------------------------
def test_deterministic_across_directories(tmp_path):
    kw = dict(seed=3, num_train=2, num_val=2, progress=False)
    ra = make_demo_data(str(tmp_path / 'a'), **kw)
    rb = make_demo_data(str(tmp_path / 'b'), **kw)
    ha, hb = _tree_hashes(tmp_path / 'a'), _tree_hashes(tmp_path / 'b')
    # coco: 4 jpg + 2 json; ade: 4 jpg + 4 png; imagenet: 4 JPEG + 2 meta; one stamp per task
    assert len(ha) == 6 + 8 + 6 + 3
    assert ha == hb
    for task in ('coco', 'ade', 'imagenet'):
        assert ra['tasks'][task]['digest'] == rb['tasks'][task]['digest']
        assert not ra['tasks'][task]['skipped']
    # a different seed gives different images
    rc = make_demo_data(str(tmp_path / 'c'), **dict(kw, seed=4))
    hc = _tree_hashes(tmp_path / 'c')
    jpgs = [k for k in ha if k.endswith('.jpg')]
    assert all(ha[k] != hc[k] for k in jpgs)
    assert rc['tasks']['coco']['digest'] != ra['tasks']['coco']['digest']


def test_stamp_skips_and_overwrite_regenerates(tmp_path, capsys):
    root = str(tmp_path / 'd')
    kw = dict(tasks=('coco', 'imagenet'), seed=1, num_train=3, num_val=2)
    first = make_demo_data(root, **kw)
    out = capsys.readouterr().out
    assert out.count('[demo_data]') == 2 and 'written' in out
    before = _tree_hashes(root)
    img = os.path.join(root, 'coco', 'train2017', '000000000001.jpg')
    mtime = os.stat(img).st_mtime_ns

    second = make_demo_data(root, **kw)
    assert 'skipped' in capsys.readouterr().out
    assert all(second['tasks'][t]['skipped'] for t in ('coco', 'imagenet'))
    assert os.stat(img).st_mtime_ns == mtime  # not rewritten
    assert second['tasks']['coco']['summary'] == first['tasks']['coco']['summary']
    with open(os.path.join(root, 'coco', STAMP_NAME)) as f:
        stamp = json.load(f)
    assert stamp['complete'] is True and stamp['params']['seed'] == 1

    # overwrite=True regenerates (restoring a damaged file) with identical bytes
    with open(img, 'wb') as f:
        f.write(b'garbage')
    third = make_demo_data(root, overwrite=True, progress=False, **kw)
    assert not third['tasks']['coco']['skipped']
    assert _tree_hashes(root) == before

    # a missing file makes the stamp stale even without overwrite
    os.remove(img)
    fourth = make_demo_data(root, progress=False, **kw)
    assert not fourth['tasks']['coco']['skipped'] and os.path.isfile(img)

    # changed arguments regenerate and remove the files of the previous run only
    foreign = os.path.join(root, 'coco', 'train2017', 'my_notes.txt')
    with open(foreign, 'w') as f:
        f.write('keep me')
    make_demo_data(root, progress=False, **dict(kw, num_train=2))
    assert not os.path.exists(os.path.join(root, 'coco', 'train2017', '000000000003.jpg'))
    assert os.path.isfile(os.path.join(root, 'coco', 'train2017', '000000000002.jpg'))
    assert os.path.isfile(foreign)
    assert len(_load_coco(root, 'train')['images']) == 2


def test_refuses_unstamped_folder(tmp_path):
    os.makedirs(tmp_path / 'coco')
    (tmp_path / 'coco' / 'real_data.txt').write_text('x')
    with pytest.raises(FileExistsError):
        make_demo_data(str(tmp_path), tasks='coco', num_train=1, num_val=1, progress=False)
    res = make_demo_data(
        str(tmp_path), tasks='coco', num_train=1, num_val=1, overwrite=True, progress=False)
    assert (tmp_path / 'coco' / 'real_data.txt').read_text() == 'x'
    assert not res['tasks']['coco']['skipped']
    with pytest.raises(ValueError):
        make_demo_data(str(tmp_path), tasks='voc', progress=False)
    with pytest.raises(ValueError):
        make_demo_data(str(tmp_path), tasks='coco', num_train=0, progress=False)


# ------------------------------------------------------------------------------------------
# COCO
# ------------------------------------------------------------------------------------------
def test_coco_layout_and_categories(demo):
    root, result = demo
    assert result['tasks']['coco']['data_root'] == os.path.join(str(root), 'coco')
    for split, num in (('train', NUM_TRAIN), ('val', NUM_VAL)):
        coco = _load_coco(root, split)
        cats = coco['categories']
        assert len(cats) == 80
        ids = [c['id'] for c in cats]
        assert ids == sorted(set(range(1, 91)) - COCO_UNUSED_IDS)
        by_id = {c['id']: c['name'] for c in cats}
        for cid, name in {**COCO_USED, **COCO_SOME_REAL}.items():
            assert by_id[cid] == name
        assert len(coco['images']) == num
        assert len({im['id'] for im in coco['images']}) == num
        for im in coco['images']:
            path = os.path.join(root, 'coco', f'{split}2017', im['file_name'])
            with Image.open(path) as pil:
                assert pil.format == 'JPEG' and pil.mode == 'RGB'
                assert pil.size == (im['width'], im['height'])
            assert 128 <= im['width'] <= 224 and 128 <= im['height'] <= 224
        ann_ids = [a['id'] for a in coco['annotations']]
        assert len(set(ann_ids)) == len(ann_ids)


def test_coco_annotations_match_pixels(demo):
    root, _ = demo
    n_checked = 0
    for split in ('train', 'val'):
        coco = _load_coco(root, split)
        images = {im['id']: im for im in coco['images']}
        per_image = {i: [] for i in images}
        for ann in coco['annotations']:
            per_image[ann['image_id']].append(ann)
        for image_id, anns in per_image.items():
            im = images[image_id]
            w, h = im['width'], im['height']
            assert 1 <= len(anns) <= 4
            arr = np.asarray(
                Image.open(os.path.join(root, 'coco', f'{split}2017', im['file_name'])),
                dtype=np.float64)
            union = np.zeros((h, w), bool)
            labels = np.full((h, w), -1)  # dominant channel of the annotated class per pixel
            for ann in anns:
                name = COCO_USED[ann['category_id']]
                assert ann['iscrowd'] == 0
                assert len(ann['segmentation']) == 1
                poly = ann['segmentation'][0]
                npts = len(poly) // 2
                assert len(poly) % 2 == 0
                if name == 'sports ball':
                    assert npts >= 24  # circle approximated by a polygon
                else:
                    assert npts == {'tv': 4, 'kite': 3}[name]
                xs, ys = np.array(poly[0::2]), np.array(poly[1::2])
                x, y, bw, bh = ann['bbox']
                # tight around the polygon and inside the image
                assert np.isclose(x, xs.min()) and np.isclose(y, ys.min())
                assert np.isclose(x + bw, xs.max()) and np.isclose(y + bh, ys.max())
                assert x >= 0 and y >= 0 and x + bw <= w and y + bh <= h
                assert 23 <= max(bw, bh) <= 91  # object size ~24-90 px
                mask = _mask_from_polygon(poly, w, h)
                assert ann['area'] == mask.sum() > 0
                assert not (union & mask).any(), 'objects overlap'
                union |= mask
                labels[mask] = DOMINANT[name]
                # the JPEG pixels under the mask have the class colour
                eroded = np.asarray(
                    Image.fromarray(mask.astype(np.uint8) * 255).filter(ImageFilter.MinFilter(5)))
                sel = eroded > 0 if (eroded > 0).sum() >= 10 else mask
                mean = arr[sel].mean(axis=0)
                dom = DOMINANT[name]
                others = [c for c in range(3) if c != dom]
                assert mean[dom] > mean[others].max() + 80, (name, mean)
                assert np.abs(mean - np.array(COCO_SHAPE_COLOURS[name])).max() < 40, (name, mean)
                n_checked += 1
            # pixel-exact: thresholding the JPEG by colour reproduces the annotated masks
            # (a mask shifted by a single pixel drops this IoU to ~0.85)
            for c in {DOMINANT[COCO_USED[a['category_id']]] for a in anns}:
                others = [o for o in range(3) if o != c]
                coloured = arr[..., c] > arr[..., others].max(axis=-1) + 60
                iou = (coloured & (labels == c)).sum() / (coloured | (labels == c)).sum()
                assert iou > 0.98, (split, im['file_name'], c, iou)
    assert n_checked >= NUM_TRAIN + NUM_VAL


def test_coco_pycocotools_agrees(demo):
    coco_mod = pytest.importorskip('pycocotools.coco')
    root, _ = demo
    for split in ('train', 'val'):
        ann_file = os.path.join(root, 'coco', 'annotations', f'instances_{split}2017.json')
        api = coco_mod.COCO(ann_file)
        assert sorted(api.getCatIds(catNms=list(COCO_USED.values()))) == sorted(COCO_USED)
        assert len(api.getImgIds()) == (NUM_TRAIN if split == 'train' else NUM_VAL)
        for ann in api.loadAnns(api.getAnnIds()):
            im = api.loadImgs(ann['image_id'])[0]
            theirs = api.annToMask(ann).astype(bool)
            ours = _mask_from_polygon(ann['segmentation'][0], im['width'], im['height'])
            iou = (theirs & ours).sum() / (theirs | ours).sum()
            assert iou > 0.95, (ann['id'], iou)


def test_mmdet_coco_dataset(demo):
    datasets = _import_or_skip('mmdet.datasets')
    root, _ = demo
    assert list(datasets.CocoDataset.METAINFO['classes']) == [
        c['name'] for c in _load_coco(root, 'val')['categories']]
    ds = datasets.CocoDataset(
        data_root=os.path.join(str(root), 'coco'),
        ann_file='annotations/instances_val2017.json',
        data_prefix=dict(img='val2017/'),
        pipeline=[],
        test_mode=True)
    assert len(ds) == NUM_VAL
    coco = _load_coco(root, 'val')
    classes = ds.metainfo['classes']
    for i in range(len(ds)):
        item = ds[i]
        assert os.path.isfile(item['img_path'])
        n_ann = sum(a['image_id'] == item['img_id'] for a in coco['annotations'])
        assert len(item['instances']) == n_ann >= 1
        names = {classes[inst['bbox_label']] for inst in item['instances']}
        assert names <= set(COCO_USED.values())


# ------------------------------------------------------------------------------------------
# ADE20K
# ------------------------------------------------------------------------------------------
def test_ade_layout_and_labels(demo):
    root, result = demo
    base = os.path.join(str(root), 'ade', 'ADEChallengeData2016')
    assert result['tasks']['ade']['data_root'] == base
    seen = set()
    for folder, prefix, num in (('training', 'ADE_train', NUM_TRAIN),
                                ('validation', 'ADE_val', NUM_VAL)):
        imgs = sorted(os.listdir(os.path.join(base, 'images', folder)))
        anns = sorted(os.listdir(os.path.join(base, 'annotations', folder)))
        assert imgs == [f'{prefix}_{i:08d}.jpg' for i in range(1, num + 1)]
        assert anns == [f'{prefix}_{i:08d}.png' for i in range(1, num + 1)]
        for img_name, ann_name in zip(imgs, anns):
            with Image.open(os.path.join(base, 'annotations', folder, ann_name)) as lab_img:
                assert lab_img.mode == 'L'
                lab = np.asarray(lab_img)
            img = np.asarray(Image.open(os.path.join(base, 'images', folder, img_name)))
            assert lab.dtype == np.uint8
            assert img.shape == lab.shape + (3, )
            assert 128 <= lab.shape[0] <= 192 and 128 <= lab.shape[1] <= 192
            values = set(np.unique(lab).tolist())
            assert values <= ADE_VALUES
            assert {0, 1, 3, 4} <= values  # border, wall, sky, floor always present
            assert (lab[0] == 0).all() and (lab[:, -1] == 0).all()  # unlabelled border
            assert lab[lab.shape[0] // 2, lab.shape[1] // 2] != 0
            seen |= values
            # sky on top, floor at the bottom; class colours are distinguishable
            sky_rows = np.nonzero((lab == 3).any(axis=1))[0]
            floor_rows = np.nonzero((lab == 4).any(axis=1))[0]
            assert sky_rows.mean() < floor_rows.mean()
            sky, floor = img[lab == 3].mean(axis=0), img[lab == 4].mean(axis=0)
            assert sky[2] > sky[0] + 40 and floor[0] > floor[2] + 30
    assert seen == ADE_VALUES


def test_mmseg_ade_dataset(demo):
    datasets = _import_or_skip('mmseg.datasets')
    root, _ = demo
    ds = datasets.ADE20KDataset(
        data_root=os.path.join(str(root), 'ade', 'ADEChallengeData2016'),
        data_prefix=dict(img_path='images/validation', seg_map_path='annotations/validation'),
        pipeline=[])
    assert len(ds) == NUM_VAL
    info = ds.get_data_info(0)
    assert os.path.isfile(info['img_path']) and os.path.isfile(info['seg_map_path'])
    assert info['reduce_zero_label'] is True
    classes = ds.metainfo['classes']
    assert [classes[v - 1] for v in (1, 3, 4, 5, 21)] == ['wall', 'sky', 'floor', 'tree', 'car']


# ------------------------------------------------------------------------------------------
# ImageNet
# ------------------------------------------------------------------------------------------
def test_imagenet_layout(demo):
    root, _ = demo
    base = os.path.join(str(root), 'imagenet')
    for split, num in (('train', NUM_TRAIN), ('val', NUM_VAL)):
        with open(os.path.join(base, 'meta', f'{split}.txt')) as f:
            lines = f.read().splitlines()
        assert len(lines) == num
        on_disk = {
            os.path.relpath(os.path.join(d, n), os.path.join(base, split))
            for d, _, files in os.walk(os.path.join(base, split)) for n in files
        }
        listed = set()
        for line in lines:
            rel, label = line.split(' ')
            label = int(label)
            assert 0 <= label <= 3
            wnid = rel.split('/')[0]
            assert IMAGENET[wnid] == label
            assert rel.endswith('.JPEG')
            with Image.open(os.path.join(base, split, rel)) as im:
                assert im.size == (64, 64) and im.mode == 'RGB'
            listed.add(rel)
        assert listed == on_disk


def test_imagenet_classes_are_distinguishable(demo):
    """Each class has its own pattern: stripe direction separates classes 0 and 1."""
    root, _ = demo
    base = os.path.join(str(root), 'imagenet')
    with open(os.path.join(base, 'meta', 'train.txt')) as f:
        items = [line.split(' ') for line in f.read().splitlines()]
    for rel, label in items:
        g = np.asarray(Image.open(os.path.join(base, 'train', rel)).convert('L'), np.float64)
        row_var = g.mean(axis=1).std()  # large for horizontal stripes
        col_var = g.mean(axis=0).std()  # large for vertical stripes
        if label == '0':
            assert row_var > 2 * col_var
        elif label == '1':
            assert col_var > 2 * row_var


def test_mmpretrain_imagenet_dataset(demo):
    datasets = _import_or_skip('mmpretrain.datasets')
    root, _ = demo
    ds = datasets.ImageNet(
        data_root=os.path.join(str(root), 'imagenet'),
        data_prefix='val',
        ann_file='meta/val.txt',
        pipeline=[])
    assert len(ds) == NUM_VAL
    info = ds.get_data_info(0)
    assert os.path.isfile(info['img_path'])
    assert int(info['gt_label']) in range(4)


# ------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------
def test_cli(tmp_path, capsys):
    env = dict(os.environ)
    env['PYTHONPATH'] = os.pathsep.join(p for p in (REPO, env.get('PYTHONPATH')) if p)
    tool = os.path.join(REPO, 'tools', 'make_demo_data.py')
    args = ['--root', str(tmp_path), '--tasks', 'imagenet', '--num-train', '4', '--num-val', '2',
            '--seed', '5']
    # a real subprocess run of the script
    out = subprocess.run([sys.executable, tool] + args, env=env, capture_output=True, text=True,
                         check=True).stdout
    assert 'imagenet: written' in out and str(tmp_path) in out
    with open(tmp_path / 'imagenet' / 'meta' / 'train.txt') as f:
        assert len(f.read().splitlines()) == 4
    assert not (tmp_path / 'coco').exists()
    # second run in-process (saves a second interpreter start-up): skipped via the stamp
    spec = importlib.util.spec_from_file_location('make_demo_data_cli', tool)
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    cli.main(args)
    assert 'imagenet: skipped' in capsys.readouterr().out
