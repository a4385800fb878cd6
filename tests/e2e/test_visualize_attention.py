"""tools/visualize_attention.py on a generated image: one PNG per model and a comparison PNG of
the expected sizes with drawn content, per-layer entropies within [0, log n], the right map kind
per family, and a softmax window map that is exactly the query's window."""
import importlib.util
import json
import math
import os.path as osp

import numpy as np
import pytest
import torch
from PIL import Image

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
spec = importlib.util.spec_from_file_location(
    'visualize_attention', osp.join(ROOT, 'tools', 'visualize_attention.py'))
vis = importlib.util.module_from_spec(spec)
spec.loader.exec_module(vis)

SIZE, PANEL = 64, 48
CELL = PANEL + vis.LABEL_H
KIND = {'swin-t_in1k': 'weights', 'pola-swin-t_in1k': 'weights', 'nala-swin-t_in1k': 'weights',
        'padre-swin-t_in1k': 'influence', 'poly-swin-t_in1k': 'influence',
        'setformer-t_in1k': 'weights'}


@pytest.fixture(scope='module')
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp('attention')
    img = tmp / 'input.png'
    vis.generated_image(96, seed=3).save(img)
    out = tmp / 'out'
    results = vis.main(['--img', str(img), '--size', str(SIZE), '--panel', str(PANEL),
                        '--entropy-queries', '2', '--out-dir', str(out)])
    return out, results


def _panels_drawn(arr, rows, cols):
    for r in range(rows):
        for c in range(cols):
            cell = arr[r * CELL + vis.LABEL_H:(r + 1) * CELL, c * PANEL:(c + 1) * PANEL]
            assert cell.std() > 1.0, f'panel ({r}, {c}) is flat'


def test_default_models_are_softmax_and_every_linear_family(run):
    out, results = run
    assert list(results) == list(KIND)
    for name, kind in KIND.items():
        layers = results[name]
        assert {lay['kind'] for lay in layers} == {kind}, name
    pola = [lay['mixer'] for lay in results['pola-swin-t_in1k']]
    assert pola == ['PolaLinearAttention'] * 4 + ['WindowSoftmaxAttention'] * 8
    assert len(results['setformer-t_in1k']) == 3 + 4 + 18 + 5


def test_pngs_have_the_expected_size_and_content(run):
    out, results = run
    for name, layers in results.items():
        n = 1 + len(layers)
        cols = min(vis.MAX_COLS, n)
        rows = math.ceil(n / cols)
        img = Image.open(out / f'{name}.png')
        assert img.size == (cols * PANEL, rows * CELL)
        arr = np.asarray(img, dtype=np.float32)
        _panels_drawn(arr, n // cols, cols)  # full rows
    comp = Image.open(out / 'comparison.png')
    assert comp.size == (5 * PANEL, len(results) * CELL)  # image + first block of 4 stages
    _panels_drawn(np.asarray(comp, dtype=np.float32), len(results), 5)


def test_entropy_json_parses_and_is_bounded(run):
    out, results = run
    data = json.loads((out / 'entropy.json').read_text())
    assert data['size'] == SIZE and data['query'] == [0.5, 0.5]
    for name, layers in data['models'].items():
        for lay in layers:
            n_keys = lay['key_grid'][0] * lay['key_grid'][1]
            assert 0 <= lay['entropy'] <= math.log(n_keys) + 1e-6, (name, lay)
            assert lay['normalized_entropy'] == pytest.approx(lay['entropy'] / math.log(n_keys))
            want_q = lay['grid'][0] * lay['grid'][1] if lay['kind'] == 'weights' else 2
            assert lay['entropy_queries'] == want_q
    # randomly initialised SeT: transport plans close to uniform, so near-uniform attention
    assert min(lay['normalized_entropy'] for lay in data['models']['setformer-t_in1k']) > 0.9


def test_softmax_window_map_is_the_query_window():
    img = vis.generated_image(SIZE)
    _, tensor = vis.load_image(None, SIZE)
    torch.manual_seed(0)
    layers = vis.analyse_model('swin-t_in1k', None, tensor, (0.5, 0.5), 1)
    first = layers[0]  # stage 1, block 0: W-MSA, 7x7 windows on the 16x16 grid (padded to 21)
    assert first['grid'] == [16, 16] and first['kind'] == 'weights'
    support = (first['map'].reshape(16, 16) > 0).numpy()
    want = np.zeros((16, 16), bool)
    want[7:14, 7:14] = True  # the query (8, 8) is in the window of rows/cols 7..13
    assert (support == want).all()
    assert img.size == (SIZE, SIZE)
