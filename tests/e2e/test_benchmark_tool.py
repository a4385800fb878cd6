"""tools/benchmark.py runs its three modes on small inputs (the speed figures themselves are in
docs/benchmarks.md, measured outside the tests): the straightforward official Pola forward and the
fast path give equal outputs, the JSON holds medians and peak memory, and the plot is written."""
import importlib
import json
import re
import runpy
import types

import pytest
import torch

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


def test_core_mode_reports_bandwidth_and_equal_outputs(tmp_path):
    out = tmp_path / 'core.json'
    res = TOOL['main'](['--mode', 'core', '--grid', '8x8', '12x10', '--batch', '2', '--heads',
                        '2', '--head-dims', '8', '--impls', 'torch', 'reference', '--compare',
                        'reference', '--warmup', '0', '--repeats', '2', '--json', str(out),
                        '--peak-bw', '100'])
    assert [r['impl'] for r in res] == ['torch', 'reference'] * 2
    for r in res:
        n_tok = r['size'][0] * r['size'][1]
        # q, k, v, output (fp32) and the fp32 position encoding once per batch item
        assert r['min_bytes'] == 4 * 2 * 2 * n_tok * 8 * 4 + 2 * 2 * n_tok * 8 * 4
        assert abs(r['achieved_gb_s'] - r['min_bytes'] / (r['latency_ms'] * 1e-3) / 1e9) < 1e-9
        assert abs(r['bw_fraction'] - r['achieved_gb_s'] / 100) < 1e-12
    assert all(r['max_abs_diff_vs_first_impl'] < 1e-5 for r in res if r['impl'] == 'reference')
    assert 'speedup_vs_reference' in res[0]
    assert load(out)['peak_bw_gb_s'] == 100
    with pytest.raises(SystemExit, match='not cores'):
        TOOL['main'](['--mode', 'core', '--impls', 'official', '--grid', '4x4'])


def test_attention_mode_nala_fast_vs_reference(tmp_path):
    res = TOOL['main'](['--mode', 'attention', '--attn', 'nala', '--grid', '10x12', '--heads',
                        '2', '--head-dims', '8', '--impls', 'reference', 'fast', '--compare',
                        'reference', '--warmup', '0', '--repeats', '2'])
    assert [r['impl'] for r in res] == ['reference', 'fast']
    assert res[0]['target'] == 'nala-attn-h2-d8'
    assert res[1]['max_abs_diff_vs_first_impl'] < 1e-5 * max(res[0]['max_abs_output'], 1e-3)
    assert 'speedup_vs_reference' in res[1]


def test_core_mode_nala_torch_equals_reference():
    res = TOOL['main'](['--mode', 'core', '--attn', 'nala', '--grid', '8x8', '--batch', '2',
                        '--heads', '2', '--head-dims', '8', '--impls', 'reference', 'torch',
                        '--compare', 'reference', '--warmup', '0', '--repeats', '2'])
    assert [(r['target'], r['impl']) for r in res] == [('nala-core-h2-d8', 'reference'),
                                                         ('nala-core-h2-d8', 'torch')]
    # q, k, v, output (fp32) and the fp32 sin / cos tables once per batch item
    assert res[0]['min_bytes'] == 4 * 2 * 2 * 64 * 8 * 4 + 2 * 2 * 64 * 8 * 4
    assert res[1]['max_abs_diff_vs_first_impl'] < 1e-5 * res[0]['max_abs_output']
    assert res[1]['max_abs_output'] > 0
    assert 'speedup_vs_reference' in res[1]


def test_set_impl_switches_the_ffn_with_the_mixers():
    """official / reference run the unconverted model (plain FFN and the strided-conv patch
    embedding of the official code), ``torch`` the unconverted model with the fast cores, ``fast``
    the converted model (fused FFN, GEMM patch embedding, chunked mixers), and ``--ffn plain``
    keeps the blocks plain."""
    from linattn_mm.deploy.blocks import PatchEmbedCPU, TransformerBlockCPU
    from linattn_mm.models.utils.layers import PatchEmbed, TransformerBlock
    net = TOOL['build_backbone']('pola-pvt-t')
    blocks = [m for m in net.modules() if isinstance(m, TransformerBlock)]
    embeds = [m for m in net.modules() if isinstance(m, PatchEmbed)]
    mixers = TOOL['pola_modules'](net)
    assert blocks and mixers
    for impl, ffn, fused, core in [('official', 'auto', False, 'reference'),
                                   ('fast', 'auto', True, 'fast'),
                                   ('reference', 'auto', False, 'reference'),
                                   ('fast', 'plain', False, 'fast'), ('torch', 'auto', False, 'fast')]:
        TOOL['set_impl'](net, impl, ffn)
        want = TransformerBlockCPU if fused else TransformerBlock
        assert [type(b) for b in blocks] == [want] * len(blocks), (impl, ffn)
        assert all(('forward' in m.__dict__) == (impl == 'official') for m in mixers)
        assert all(m.core == core for m in mixers), (impl, ffn)
        assert [type(m) for m in embeds] == [PatchEmbedCPU if impl == 'fast' else PatchEmbed] * 4


def test_train_mode_counts_operations_on_cpu_and_meta(tmp_path, capsys):
    """``--count-ops``: the operations of one more training step next to its time and memory;
    ``--device meta``: the operations and the peak of live tensors of the paths taken off CPU (no
    time), with ratios against the baseline; other dtypes than float32 are refused there (meta
    tensors have no autocast)."""
    cpu, meta = tmp_path / 'cpu.json', tmp_path / 'meta.json'
    TOOL['main'](['--mode', 'train', 'pola-swin-t', 'swin-t', '--sizes', '64x96', '--warmup',
                  '0', '--repeats', '1', '--count-ops', '--json', str(cpu)])
    rows = {r['target']: r for r in load(cpu)['results']}
    assert all(r['operations'] > 100 and r['latency_ms'] > 0 for r in rows.values())
    capsys.readouterr()
    TOOL['main'](['--mode', 'train', 'pola-swin-t', 'swin-t', '--sizes', '800x1344', '--device',
                  'meta', '--warmup', '0', '--repeats', '1', '--compare', 'swin-t', '--json',
                  str(meta)])
    text = capsys.readouterr().out
    rows = {r['target']: r for r in load(meta)['results']}
    got = {t: r['operations'] for t, r in rows.items()}
    assert got['pola-swin-t'] > 1000 and got['swin-t'] > 1000
    assert all(r['latency_ms'] is None and r['peak_mem_mb'] > 500 for r in rows.values())
    mem = rows['pola-swin-t']['peak_mem_mb'] / rows['swin-t']['peak_mem_mb']
    assert f'operations {got["pola-swin-t"] / got["swin-t"]:.2f}x' in text
    assert f'memory {mem:.2f}x' in text
    with pytest.raises(SystemExit, match='training steps only'):
        TOOL['main'](['--mode', 'backbone', 'swin-t', '--device', 'meta'])


def test_train_mode_operations_by_module(tmp_path, capsys):
    """``--ops-by-module N``: one more step of each target counted by module class, the N entries
    with the most operations printed under its row and kept in the JSON file, in order. With N
    above the number of entries they add up to the step's operations."""
    js = tmp_path / 'mods.json'
    TOOL['main'](['--mode', 'train', 'nalaformer-t', '--sizes', '256x384', '--device', 'meta',
                  '--dtype', 'bf16', '--warmup', '0', '--repeats', '1', '--impls', 'fast',
                  'triton', '--ops-by-module', '3', '--json', str(tmp_path / 'top.json')])
    TOOL['main'](['--mode', 'train', 'nalaformer-t', '--sizes', '256x384', '--device', 'meta',
                  '--dtype', 'bf16', '--warmup', '0', '--repeats', '1', '--impls', 'fast',
                  'triton', '--ops-by-module', '100', '--json', str(js)])
    text = capsys.readouterr().out
    top = {r['impl']: r for r in load(tmp_path / 'top.json')['results']}
    rows = {r['impl']: r for r in load(js)['results']}
    assert set(rows) == set(top) == {'fast', 'triton'}
    for impl, r in rows.items():
        mods = r['operations_by_module']
        counts = [m['operations'] for m in mods]
        assert 10 < len(mods) < 100 and sum(counts) == r['operations']
        assert counts == sorted(counts, reverse=True)
        assert top[impl]['operations_by_module'] == mods[:3]
        assert all(m['phase'] in ('forward', 'backward') for m in mods)
        for m in mods:
            assert re.search(rf'^    {re.escape(m["module"])}\s+{m["phase"]}\s+{m["operations"]} ops '
                             rf'\(\s*[\d.]+%\)\s+[\d.]+ GB$', text, re.M), text

    def nala(r):  # the NaLa mixers' own operations, forward and backward
        return sum(m['operations'] for m in r['operations_by_module']
                   if m['module'] == 'NormAwareLinearAttention')
    assert 0 < nala(rows['triton']) < nala(rows['fast'])
    with pytest.raises(SystemExit, match='--ops-by-module N'):
        TOOL['main'](['--mode', 'backbone', 'swin-t', '--ops-by-module', '3'])


def test_train_mode_on_meta_under_cudas_autocast(tmp_path):
    """``--device meta --dtype bf16``: the step's forward under CUDA's autocast
    (:func:`linattn_mm.utils.meta_autocast`): the products in bfloat16, fewer bytes than the
    float32 step (the layer norms and softmaxes stay in float32), more operations (the casts),
    less kept for backward."""
    rows = {}
    for dt in ('fp32', 'bf16'):
        js = tmp_path / f'{dt}.json'
        TOOL['main'](['--mode', 'train', 'swin-t', '--sizes', '256x384', '--device', 'meta',
                      '--dtype', dt, '--warmup', '0', '--repeats', '1', '--json', str(js),
                      '--roofline', 'h200'])
        rows[dt] = load(js)['results'][0]
    fp32, bf16 = rows['fp32'], rows['bf16']
    assert bf16['operations'] > fp32['operations']
    assert 0.5 < bf16['bytes_moved'] / fp32['bytes_moved'] < 0.85
    assert bf16['peak_mem_mb'] < 0.9 * fp32['peak_mem_mb']
    assert bf16['flops'] == fp32['flops']  # the same products, in another dtype


def test_fused_attention_on_meta_runs_the_fused_kernel_and_restores_sdpa():
    """On meta, the tool's softmax attention is the fused kernel of a GPU (one operation each way,
    no (N, N) matrix: the peak of live tensors is that of q, k, v, the output and its
    log-sum-exp), elsewhere the original function; the original is back afterwards."""
    import torch
    import torch.nn.functional as F
    from linattn_mm.utils import OperationCounter, PeakMemoryCounter
    sdpa = F.scaled_dot_product_attention
    q, k, v = (torch.randn(1, 2, 4096, 32, device='meta', requires_grad=True) for _ in range(3))
    with TOOL['fused_attention_on_meta']():
        with OperationCounter() as ops, PeakMemoryCounter(include_meta=True) as mem:
            F.scaled_dot_product_attention(q, k, v).sum().backward()
        x = torch.randn(1, 1, 5, 4)
        assert torch.equal(F.scaled_dot_product_attention(x, x, x), sdpa(x, x, x))
    assert F.scaled_dot_product_attention is sdpa
    assert ops.by_name['_scaled_dot_product_efficient_attention'] == 1
    assert ops.by_name['_scaled_dot_product_efficient_attention_backward'] == 1
    assert 'bmm' not in ops.by_name and '_softmax' not in ops.by_name
    assert mem.peak_bytes < 4096 * 4096 * 4  # one head's attention matrix would be 64 MiB
    # under CUDA's autocast on meta: the inputs cast to bfloat16 (as autocast casts those of
    # scaled_dot_product_attention), the flash kernel without a mask, the memory-efficient one
    # with a mask (Swin's windows)
    from linattn_mm.utils import meta_autocast
    mask = torch.zeros(4096, 4096, device='meta')
    for attn_mask, kernel in ((None, '_scaled_dot_product_flash_attention'),
                              (mask, '_scaled_dot_product_efficient_attention')):
        with TOOL['fused_attention_on_meta'](), OperationCounter() as ops:
            with meta_autocast(torch.bfloat16):
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
            assert out.dtype == torch.bfloat16
            out.float().sum().backward()
        assert ops.by_name[kernel] == 1 and ops.by_name[kernel + '_backward'] == 1
        assert ops.by_name['_to_copy'] >= 3 and 'bmm' not in ops.by_name


def test_train_mode_times_compiled_backbones(tmp_path):
    """``--compile BACKEND``: the backbones' training steps compiled (the warm-up step traces
    them); the compiled step has the eager step's loss. Only training steps of backbones, with a
    warm-up step, are compiled; other uses are refused with a message that says so."""
    out = {}
    for tag, extra in (('eager', []), ('compiled', ['--compile', 'aot_eager'])):
        js = tmp_path / f'{tag}.json'
        TOOL['main'](['--mode', 'train', 'pola-swin-t', '--sizes', '64x96', '--warmup', '1',
                      '--repeats', '1', '--json', str(js)] + extra)
        data = load(js)
        out[tag] = data['results'][0]
        assert data['args']['compile'] == (extra[1] if extra else None)
    assert out['compiled']['latency_ms'] > 0 and out['eager']['peak_mem_mb'] > 0
    assert out['compiled']['peak_mem_mb'] != out['compiled']['peak_mem_mb']  # NaN: not measured
    loss = out['eager']['max_abs_output']  # a training step's output: its loss (same seed)
    assert abs(out['compiled']['max_abs_output'] - loss) <= 1e-5 * loss
    for argv in (['--mode', 'backbone', 'swin-t', '--compile'],
                 ['--mode', 'train', 'swin-t', '--compile', '--warmup', '0'],
                 ['--mode', 'train', 'swin-t', '--compile', '--device', 'meta'],
                 ['--mode', 'train', 'swin-t', '--compile', '--count-ops']):
        with pytest.raises(SystemExit, match='--compile times compiled training steps'):
            TOOL['main'](argv)


def test_training_impls_switch_cores_and_forwards_cleanly():
    # --mode train alternates the implementations on one model: 'official' binds its own Pola
    # forward, and the 'triton' training form that follows must drop it (else it would time the
    # official forward) and put the Pola and NaLa mixers on the Triton core; CPU is refused
    from linattn_mm.models.attentions.nala import NormAwareLinearAttention
    from linattn_mm.models.attentions.pola import PolaLinearAttention
    pytest.importorskip('triton')
    model = torch.nn.Sequential(PolaLinearAttention(16, 2, pretrain_hw=(4, 4)),
                                NormAwareLinearAttention(16, 2))
    TOOL['set_impl'](model, 'official', train=True)
    assert 'forward' in model[0].__dict__
    with pytest.raises(ValueError, match='trains on --device cuda'):
        TOOL['set_impl'](model, 'triton', train=True)
    TOOL['set_impl'](model.to('meta'), 'triton', train=True)
    assert 'forward' not in model[0].__dict__
    assert model[0].core == 'triton' and model[1].core == 'triton'
    TOOL['set_impl'](model, 'fast', train=True)
    assert model[0].core == 'fast' and model[1].core == 'fast'
    # 'fused': both mixers on their fused cores; a NaLa map with a constant query power has
    # none and keeps the torch core
    TOOL['set_impl'](model, 'fused', train=True)
    assert model[0].core == 'fused' and model[1].core == 'fused'
    model[1].query_power = 2.
    TOOL['set_impl'](model, 'fused', train=True)
    assert model[0].core == 'fused' and model[1].core == 'fast'
    with pytest.raises(ValueError, match='--impls fused runs on --device cuda'):
        TOOL['set_impl'](model, 'fused', device='cpu', train=True)


def test_core_mode_backward_times_training_steps():
    # --backward: forward and backward of each core, the same output for both, and the least
    # traffic of a training step (11 passes over (B, h, N, d) in the input dtype, the float32
    # position encoding read twice per batch item and its gradient written once)
    B, h, N, d = 2, 2, 64, 8
    res = TOOL['main'](['--mode', 'core', '--grid', '8x8', '--batch', str(B), '--heads', str(h),
                        '--head-dims', str(d), '--impls', 'torch', 'reference', '--warmup', '0',
                        '--repeats', '1', '--backward'])
    assert [r['target'] for r in res] == ['pola-core-h2-d8-train'] * 2
    pe = h * N * d * 4
    assert all(r['min_bytes'] == 11 * B * h * N * d * 4 + 2 * B * pe + pe for r in res)
    assert res[1]['max_abs_diff_vs_first_impl'] < 1e-5 * max(1.0, res[1]['max_abs_output'])


def test_log_progress_goes_to_stderr_in_order(capsys):
    # --log-progress: each build, warm-up, the timed rounds and each memory run as a line on
    # stderr (a run stopped by a time limit shows how far it came); stdout, which scripts parse,
    # stays as without it
    argv = ['--mode', 'train', 'pola-pvt-t', 'pvt-t', '--sizes', '32x48', '--batch', '1',
            '--warmup', '1', '--repeats', '2', '--compare', 'pola-pvt-t:pvt-t']
    TOOL['main'](argv + ['--log-progress'])
    out, err = capsys.readouterr()
    lines = [ln for ln in err.splitlines() if ln.startswith('# progress ')]
    steps = [re.sub(r'[\d.]+ s', 'T s', ln.split(': ', 1)[1]) for ln in lines]
    assert steps == ['built pola-pvt-t in T s', 'built pvt-t in T s',
                     'warm-up of pola-pvt-t | fast: T s', 'warm-up of pvt-t | -: T s',
                     '2 timed rounds', 'memory run of pola-pvt-t | fast', 'memory run of pvt-t | -']
    elapsed = [float(re.match(r'# progress ([\d.]+) s: ', ln).group(1)) for ln in lines]
    assert elapsed == sorted(elapsed)
    assert '# progress' not in out and re.search(r'^pola-pvt-t\s+fast\s+32x48: [\d.]+x', out, re.M)
    TOOL['main'](argv)
    out2, err2 = capsys.readouterr()
    assert '# progress' not in err2 + out2
    # the same lines on stdout, timings aside
    strip = lambda text: [re.sub(r'\s+', ' ', re.sub(r'[\d.]+', 'N', ln))  # noqa: E731
                          for ln in text.splitlines()]
    assert strip(out2) == strip(out)


def test_core_profile(capsys):
    # --profile N: after the measurements, a table of the operations that took the most time in
    # N calls of each implementation (on CPU: torch's operators and the autograd Functions)
    TOOL['main'](['--mode', 'core', '--attn', 'pola', '--backward', '--grid', '8x8', '--batch',
                  '1', '--impls', 'torch', 'reference', '--warmup', '0', '--repeats', '1',
                  '--profile', '3'])
    out = capsys.readouterr().out
    torch_part, reference_part = out.split('# profile of torch, 3 calls, 8x8:')[1].split(
        '# profile of reference, 3 calls, 8x8:')
    assert 'PolarityAttentionBackward' in torch_part and 'Self CPU time total' in torch_part
    assert 'PolarityAttentionBackward' not in reference_part  # plain autograd there
    counts = re.findall(r'^\s*PolarityAttention\s.*\s(\d+)\s*$', torch_part, re.M)
    assert counts == ['3']  # the forward Function once per call
    # above each table a line with each profiled call's wall time (no device activity on CPU)
    walls = re.search(r'^# 3 calls under the profiler: wall median ([\d.]+) ms per call '
                      r'\(each: ([\d., ]+) ms\)$', torch_part, re.M)
    each = [float(w) for w in walls.group(2).split(', ')]
    assert len(each) == 3 and float(walls.group(1)) == pytest.approx(sorted(each)[1], abs=0.051)
    assert 'device busy' not in torch_part


def test_profile_summary_device_share():
    # on a GPU the line also says how long the device worked per call and what share of the
    # wall time that is (well under 100 %: the host paced the calls), and how many kernels and
    # copies ran per call; CPU rows and user annotations do not count. torch's own profiler
    # rows: events as a CUDA profile records them (operators on the host, four kernels on the
    # device, an annotation), averaged by torch
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import EventList, FunctionEvent

    def event(i, name, start, end, device=DeviceType.CPU, annotation=False):
        return FunctionEvent(id=i, name=name, thread=0, start_us=start, end_us=end,
                             input_shapes=[], stack=[], use_device='cuda', device_type=device,
                             is_user_annotation=annotation)

    def averages(*evts):
        out = EventList(list(evts), use_device='cuda')
        out._build_tree()  # as the profiler does before averaging
        return out.key_averages()
    events = averages(
        event(0, 'aten::mm', 0, 100), event(1, 'aten::mm', 500, 600),
        event(2, 'gemm_kernel', 10, 18010, DeviceType.CUDA),
        event(3, 'gemm_kernel', 510, 6510, DeviceType.CUDA),
        event(4, 'copy_kernel', 700, 6700, DeviceType.CUDA),
        event(6, 'fill_kernel', 800, 800, DeviceType.CUDA),
        event(5, 'step', 0, 90000, DeviceType.CUDA, annotation=True))
    line = TOOL['profile_summary'](events, [0.040, 0.060])
    assert line == ('# 2 calls under the profiler: wall median 50.0 ms per call (each: 40.0, '
                    '60.0 ms); device busy 15.0 ms per call (30% of the mean wall), 2 kernels and '
                    'copies per call')
    assert TOOL['profile_summary'](averages(event(0, 'aten::mm', 0, 100)), [0.0123]) == (
        '# 1 call under the profiler: wall median 12.3 ms per call (each: 12.3 ms)')


def test_training_step_profile(capsys, monkeypatch):
    # --profile N in the other modes: N training steps of each target and implementation under
    # the profiler after the timings (on CPU: torch's operators and the autograd Functions); the
    # whole tables here (the tool prints the 12 rows that took the most time)
    table = TOOL['profile_table']
    monkeypatch.setitem(TOOL['main'].__globals__, 'profile_table',
                        lambda fn, device, calls: table(fn, device, calls, rows=1000))
    TOOL['main'](['--mode', 'train', 'pola-pvt-t', 'pvt-t', '--sizes', '32', '--impls', 'fast',
                  'reference', '--warmup', '0', '--repeats', '1', '--profile', '2'])
    out = capsys.readouterr().out
    parts = re.split(r'^# profile of (.*), 2 calls, 32x32:$', out, flags=re.M)
    tables = dict(zip(parts[1::2], parts[2::2]))
    assert set(tables) == {'pola-pvt-t | fast', 'pola-pvt-t | reference', 'pvt-t | -'}
    # the backward of the lean training Function of the Pola core, once per layer and step (2
    # layers in each of the 4 stages of PVT-T, 2 steps), against plain autograd in the reference
    counts = re.findall(r'^\s*PolarityAttentionBackward\s.*\s(\d+)\s*$',
                        tables['pola-pvt-t | fast'], re.M)
    assert counts == ['16']
    assert 'PolarityAttention' not in tables['pola-pvt-t | reference']
    assert 'PolarityAttention' not in tables['pvt-t | -']
    assert all('Self CPU time total' in t for t in tables.values())


def test_core_with_tensor_core_products_or_another_launch():
    # --mode core --impls triton-tf32x3: the Triton core (forward and backward) run inside
    # triton_dot_precision('tf32x3'); triton-w4b64 inside triton_core_launch with the gradient
    # passes' launch of 0.6.11 (4 warps, blocks of 64); the other implementations as they are
    from linattn_mm.ops.dispatch import core_launch, dot_precision
    seen = []

    def step():
        seen.append((dot_precision(), core_launch(32, 'backward'), core_launch(32)))
    step.train = True
    for impl in ('triton-tf32x3', 'triton-w4b64', 'triton', 'torch'):
        run = TOOL['_in_triton_variant'](impl, step)
        run()
        assert run.train is True
    assert seen == [('tf32x3', (8, 32), (4, 64)), ('ieee', (4, 64), (4, 64)),
                    ('ieee', (8, 32), (4, 64)), ('ieee', (8, 32), (4, 64))]
    assert dot_precision() == 'ieee' and core_launch(32, 'backward') == (8, 32)
    assert TOOL['CORE_NAMES']['triton-tf32x3'] == TOOL['CORE_NAMES']['triton-w4b64'] == 'triton'
    for impl in ('triton-tf32x3', 'triton-w4b64'):
        with pytest.raises(SystemExit, match=f'{impl} .* is an implementation of --mode core'):
            TOOL['main'](['--mode', 'train', 'pvt-t', '--impls', impl])
    with pytest.raises(SystemExit, match='--profile times .* not on --device meta'):
        TOOL['main'](['--mode', 'train', 'pvt-t', '--device', 'meta', '--profile', '2'])


def test_core_mode_runs_each_core_in_its_precision_and_launch(monkeypatch):
    # the core mode's calls of the Pola core, forward and backward: triton-tf32x3 inside
    # triton_dot_precision('tf32x3'), triton-w4b64 inside triton_core_launch, the others not (the
    # Triton kernels themselves need CUDA here; the precision and launch they would compile with
    # are what the core reads when it launches)
    import linattn_mm.ops.pola as pola_ops
    from linattn_mm.ops.dispatch import core_launch, dot_precision
    seen = []
    real = pola_ops.polarity_attention

    def settings(core, phase):
        return (core, phase, dot_precision(), core_launch(32, 'backward'))

    def recording(*args, core=None, **kwargs):
        seen.append(settings(core, 'forward'))
        out = real(*args, core='fast', **kwargs)
        out.register_hook(lambda grad: seen.append(settings(core, 'backward')))
        return out
    monkeypatch.setattr(pola_ops, 'polarity_attention', recording)
    TOOL['main'](['--mode', 'core', '--attn', 'pola', '--backward', '--grid', '8x8', '--batch',
                  '1', '--impls', 'triton-tf32x3', 'triton-w4b64', 'triton', 'torch',
                  '--warmup', '1', '--repeats', '1'])
    assert set(seen) == {(core, phase, prec, launch) for phase in ('forward', 'backward')
                         for core, prec, launch in (('triton', 'tf32x3', (8, 32)),
                                                    ('triton', 'ieee', (4, 64)),
                                                    ('triton', 'ieee', (8, 32)),
                                                    ('fast', 'ieee', (8, 32)))}
    assert dot_precision() == 'ieee' and core_launch(32, 'backward') == (8, 32)
    # the launch of 0.6.11 at head dims up to 32, of its gradient passes: a core's backward at
    # d <= 32 only
    for extra in (['--backward', '--head-dims', '64'], []):
        with pytest.raises(SystemExit, match=r'triton-w4b64 .* needs --backward and --head-dims '
                                             r'of 32 or less'):
            TOOL['main'](['--mode', 'core', '--attn', 'pola', '--grid', '8x8', '--impls',
                          'triton-w4b64', 'torch', '--warmup', '1', '--repeats', '1'] + extra)


def _boxes(g, n, size=64.):
    xy = torch.rand(n, 2, generator=g) * size
    wh = 4 + torch.rand(n, 2, generator=g) * size / 2
    return torch.cat([xy, xy + wh], 1)


def test_mmcv_ops_routed_to_torchvision_equal_mmcv_ones():
    """--mmcv-ops torchvision (a GPU with an mmcv built without its CUDA ops): NMS keeps the same
    boxes and RoIAlign gives the same features and input gradients as mmcv's compiled CPU ops,
    and mmcv's own ops are back after the run."""
    ops = pytest.importorskip('mmcv.ops')
    nms_mod, roi_mod = (importlib.import_module(f'mmcv.ops.{m}') for m in ('nms', 'roi_align'))
    g = torch.Generator().manual_seed(0)
    boxes, scores = _boxes(g, 300), torch.rand(300, generator=g)
    feats = torch.randn(2, 5, 20, 24, generator=g)
    rois = torch.cat([torch.randint(0, 2, (40, 1), generator=g).float(),
                      _boxes(g, 40, size=80.)], 1)

    def run_ops():
        dets, keep = ops.nms(boxes, scores, 0.5)
        out = []
        for aligned, ratio in ((True, 0), (False, 2)):
            x = feats.clone().requires_grad_()
            y = ops.roi_align(x, rois, (7, 6), 0.25, ratio, 'avg', aligned)
            (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
            out += [y.detach(), x.grad]
        return dets, keep, out

    own = run_ops()
    original = nms_mod.ext_module, roi_mod.ext_module
    restore = TOOL['route_mmcv_ops_to_torchvision']()
    try:
        routed = run_ops()
        assert isinstance(nms_mod.ext_module, TOOL['TorchvisionMmcvOps'])
        with pytest.raises(NotImplementedError, match='max pooling'):
            ops.roi_align(feats, rois, (7, 7), 0.25, 0, 'max', True)
        with pytest.raises(NotImplementedError, match='offset'):
            ops.nms(boxes, scores, 0.5, offset=1)
    finally:
        restore()
    assert (nms_mod.ext_module, roi_mod.ext_module) == original
    assert 20 < len(own[1]) < 300 and torch.equal(own[1], routed[1])
    torch.testing.assert_close(routed[0], own[0])
    for a, b in zip(own[2], routed[2]):
        assert a.abs().max() > 0.1
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)


def test_mmcv_ops_option_restores_mmcv_after_the_run():
    pytest.importorskip('mmcv.ops')
    mmcv_nms = importlib.import_module('mmcv.ops.nms')
    original = mmcv_nms.ext_module
    seen = []
    real = TOOL['_main']

    def spy(args):
        seen.append(type(mmcv_nms.ext_module).__name__)
        return real(args)
    TOOL['main'].__globals__['_main'] = spy
    try:
        TOOL['main'](['--mode', 'core', '--grid', '4x4', '--batch', '1', '--heads', '1',
                      '--head-dims', '4', '--impls', 'torch', '--warmup', '0', '--repeats', '1',
                      '--mmcv-ops', 'torchvision'])
    finally:
        TOOL['main'].__globals__['_main'] = real
    assert seen == ['TorchvisionMmcvOps'] and mmcv_nms.ext_module is original


def test_fused_launch_option_sets_the_fused_kernels_launch_for_the_run(tmp_path):
    # --fused-launch WARPS:ELEMENTS: the fused forms' kernels of the whole run launch so
    # (dispatch.fused_launch), restored afterwards. On meta the launches are counted: the same
    # operations, and the partial sums over the tokens have one row per program, so smaller
    # tiles make more programs at this size (4 multiprocessors off CUDA) and move more bytes
    from linattn_mm.ops import dispatch
    seen = []
    real = TOOL['_main']

    def spy(args):
        seen.append((dispatch.fused_warps(), dispatch.fused_block(32)))
        return real(args)
    rows = {}
    TOOL['main'].__globals__['_main'] = spy
    try:
        for launch in (None, '8:256'):
            js = tmp_path / f'{launch}.json'
            TOOL['main'](['--mode', 'train', 'pola-swin-t', '--sizes', '128x192', '--device',
                          'meta', '--dtype', 'bf16', '--impls', 'fused', '--warmup', '0',
                          '--repeats', '1', '--json', str(js)]
                         + ([] if launch is None else ['--fused-launch', launch]))
            rows[launch] = load(js)
    finally:
        TOOL['main'].__globals__['_main'] = real
    assert seen == [(4, 64), (8, 16)]
    assert dispatch.fused_warps() == 4 and dispatch.fused_block(32) == 64
    assert rows['8:256']['args']['fused_launch'] == [8, 256]
    default, small = rows[None]['results'][0], rows['8:256']['results'][0]
    assert small['operations'] == default['operations']
    assert small['bytes_moved'] > default['bytes_moved']


def test_bad_arguments_are_refused_before_anything_is_measured(capsys):
    """Malformed sizes, unknown targets and --compare baselines that name nothing of the run are
    errors up front (an unknown target failed after the others were measured; an unknown
    baseline was ignored)."""
    main = TOOL['main']
    for argv, message in (
            (['pola-pvt-t', '--sizes', '128by128'], "'128by128' is not a size: give S or HxW"),
            (['--mode', 'attention', '--grid', '16x'], "'16x' is not a size"),
            (['pola-pvt-t', 'swin_t', '--sizes', '64'], "unknown target(s) ['swin_t']"),
            (['pola-pvt-t', '--sizes', '64', '--compare', 'nosuch'],
             "--compare nosuch: 'nosuch' is neither a target nor an implementation of this run "
             "(fast, pola-pvt-t)"),
            (['--mode', 'core', '--grid', '8x8', '--compare', 'fast'],
             "'fast' is neither a target nor an implementation of this run (torch)"),
            (['pola-pvt-t', '--fused-launch', '8:1000'],
             "'8:1000': WARPS:ELEMENTS, warps 1, 2, 4, 8 or 16 and elements a power of two >= "
             "256"),
            (['pola-pvt-t', '--fused-launch', '8'], "'8': WARPS:ELEMENTS"),
            (['pola-pvt-t', '--profile', '0'], '--profile CALLS: at least one call, got 0')):
        with pytest.raises(SystemExit) as e:
            main(argv + ['--warmup', '0', '--repeats', '1'])
        captured = capsys.readouterr()  # argparse's errors on stderr, the others in the exit
        assert message in captured.err + str(e.value.code), (argv, captured.err[-500:])
        assert 'ms (min' not in captured.out  # nothing measured


def test_half_precision_on_cpu_skips_only_the_inference_forms(tmp_path, capsys):
    """--dtype bf16 on CPU: a target without Pola / NaLa mixers runs (its plain forms under
    autocast), and a target with them drops --impls fast with a note and runs the others; the
    core mode's --compare torch (its default implementation) is taken."""
    out = tmp_path / 'b.json'
    TOOL['main'](['swin-t', 'pola-pvt-t', '--sizes', '64', '--dtype', 'bf16', '--impls', 'fast',
                  'torch', '--warmup', '0', '--repeats', '1', '--json', str(out)])
    text = capsys.readouterr().out
    assert 'pola-pvt-t: --impls fast skipped under --dtype bf16' in text
    rows = {(r['target'], r['impl']) for r in load(out)['results']}
    assert rows == {('swin-t', '-'), ('pola-pvt-t', 'torch')}
    TOOL['main'](['--mode', 'core', '--grid', '8x8', '--compare', 'torch', '--warmup', '0',
                  '--repeats', '1'])
    assert 'torch' in capsys.readouterr().out
