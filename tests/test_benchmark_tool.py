"""tools/benchmark.py runs its three modes on small inputs (the speed figures themselves are in
docs/benchmarks.md, measured outside the tests): the straightforward official Pola forward and the
fast path give equal outputs, the JSON holds medians and peak memory, and the plot is written."""
import json
import runpy

import pytest

TOOL = runpy.run_path('tools/benchmark.py', run_name='linattn_benchmark')


def load(path):
    with open(path) as f:
        return json.load(f)


def test_attention_mode_official_vs_fast(tmp_path):
    out = tmp_path / 'attn.json'
    TOOL['main'](['--mode', 'attention', '--grid', '12x12', '16x20', '--heads', '2',
                  '--head-dims', '8', '--impls', 'official', 'reference', 'fast', '--compare',
                  'official', '--warmup', '0', '--repeats', '2', '--json', str(out)])
    text = json.dumps(load(out))
    assert 'official' in text and 'fast' in text and 'reference' in text
    diffs = [float(v) for v in _find(load(out), 'max_abs_diff_vs_first_impl') if v is not None]
    assert diffs and max(diffs) < 1e-5
    assert all(float(v) > 0 for v in _find(load(out), 'latency_ms'))


def test_backbone_mode_with_plot(tmp_path):
    pytest.importorskip('matplotlib')
    out, png = tmp_path / 'bb.json', tmp_path / 'scale.png'
    TOOL['main'](['--mode', 'backbone', 'pola-pvt-t', '--sizes', '64', '96', '--warmup', '0',
                  '--repeats', '1', '--json', str(out), '--plot', str(png)])
    assert png.stat().st_size > 1000
    assert len(list(_find(load(out), 'latency_ms'))) >= 2
    assert all(float(v) > 0 for v in _find(load(out), 'peak_mem_mb'))


def _find(obj, key):
    """Every value stored under ``key`` anywhere in a JSON structure."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k == key:
                yield v
            else:
                yield from _find(v, key)
    elif isinstance(obj, list):
        for v in obj:
            yield from _find(v, key)
