"""tools/gpu_benchmarks.sh: the GPU figures of docs/benchmarks.md in one run. Without a GPU its
benchmark commands run here as the documented GPU commands are run by test_doc_commands.py: the
same tool, mode, targets and flags, only the device (``meta`` for the training steps, which counts
them with the Triton cores as on a GPU; CPU for the rest), sizes and repeats changed; the CUDA
test files it names exist; a bad part name or a machine without a GPU stops it before anything
runs, with the reason."""
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time

import pytest
import torch
from harness import REPO, run_python

SCRIPT = 'tools/gpu_benchmarks.sh'
PARTS = ['tests', 'train_fused', 'profile_fused', 'fused_w8', 'fused_e1024', 'pola_core',
         'nala_core', 'pola_core64', 'nala_core64', 'train_b8', 'train_b1', 'train_profile',
         'infer_b8', 'infer_b1', 'maskrcnn']
STOCK_MRCNN = 'mmdet::swin/mask-rcnn_swin-t-p4-w7_fpn_1x_coco.py'


def script(*args, **env):
    return subprocess.run(['bash', SCRIPT, *args], capture_output=True, text=True,
                          env={**os.environ, 'PYTHON': sys.executable, **env})


def printed():
    """part -> its command (argv), as ``--print`` writes them."""
    res = script('--print')
    assert res.returncode == 0, res.stderr
    cmds = {}
    for line in res.stdout.splitlines():
        part, cmd = line.split(': ', 1)
        cmds[part] = shlex.split(cmd)
    return cmds


def override(argv, **values):
    """``argv`` with the values of the flags named (``device='cpu'`` for ``--device``) replaced;
    the tool and every other flag kept."""
    out = list(argv)
    for key, vals in values.items():
        flag = '--' + key.replace('_', '-')
        i = out.index(flag)  # the flag must be there: only values change
        j = i + 1
        while j < len(out) and not out[j].startswith('--'):
            j += 1
        out[i + 1:j] = vals if isinstance(vals, list) else [vals]
    return out


def run(argv, tmp_path):
    """A part's command (the script's ``$PYTHON``, this interpreter, on a tool), forked as the
    doc commands' tools are (``harness.run_python``)."""
    argv = override(argv, json=str(tmp_path / 'out.json'))
    assert argv[0] == sys.executable, argv
    res = run_python(argv[1:], cwd=REPO)
    out = res.stdout + res.stderr
    assert res.returncode == 0 and 'FAILED' not in out, out[-3000:]
    assert (tmp_path / 'out.json').stat().st_size > 0
    return out


def test_parts_and_their_commands():
    cmds = printed()
    assert list(cmds) == PARTS
    for part, argv in cmds.items():
        assert argv[0] == sys.executable, (part, argv)
        if part == 'tests':
            folders = [a for a in argv if a.startswith('tests/')]
            assert folders == ['tests/kernels', 'tests/models'], argv
            assert all(os.path.isdir(os.path.join(REPO, f)) for f in folders), folders
            assert argv[argv.index('-k') + 1] == 'cuda', argv  # the CUDA tests of both folders
        else:  # every benchmark on the GPU, each writing its JSON file into the output folder
            assert argv[1] == 'tools/benchmark.py' and '--device' in argv, argv
            assert argv[argv.index('--device') + 1] == 'cuda'
            assert argv[argv.index('--json') + 1] == f'OUT_DIR/{part}.json'
            assert '--log-progress' in argv  # a part stopped by its limit shows how far it came
    assert cmds['train_b8'][cmds['train_b8'].index('--batch') + 1] == '8'
    assert cmds['train_b1'][cmds['train_b1'].index('--batch') + 1] == '1'
    assert cmds['infer_b8'][cmds['infer_b8'].index('--batch') + 1] == '8'
    assert cmds['infer_b1'][cmds['infer_b1'].index('--batch') + 1] == '1'
    assert cmds['infer_b1'][:cmds['infer_b1'].index('--batch')] == \
        cmds['infer_b8'][:cmds['infer_b8'].index('--batch')]


def test_bad_part_or_arguments_stop_before_anything_runs(tmp_path):
    res = script(str(tmp_path / 'out'), 'train_b8', 'nope')
    assert res.returncode == 2 and "unknown part 'nope'" in res.stderr
    assert 'parts: tests train_fused profile_fused fused_w8 fused_e1024 pola_core' in res.stderr
    assert not (tmp_path / 'out').exists()
    res = script()
    assert res.returncode == 2 and res.stderr.startswith('usage: bash tools/gpu_benchmarks.sh')


@pytest.mark.skipif(torch.cuda.is_available(), reason='this machine has a GPU')
def test_no_gpu_is_named(tmp_path):
    res = script(str(tmp_path / 'out'), 'train_b1')
    assert res.returncode == 2
    assert 'sees no CUDA GPU (torch.cuda.is_available() is False)' in res.stderr
    assert not (tmp_path / 'out').exists()



@pytest.mark.parametrize('part', ['train_b8', 'train_b1'])
def test_training_steps_counted_as_on_a_gpu(part, tmp_path):
    """On ``meta`` the training steps run with the torch, fused and Triton cores, under CUDA's
    autocast."""
    out = run(override(printed()[part], device='meta', sizes='64x96', warmup='0', repeats='1'),
              tmp_path)
    assert 'device meta' in out and 'dtype bf16' in out
    for base, name in (('swin-t', 'pola-swin-t'), ('swin-t', 'nalaformer-t'),
                       ('pvt-t', 'pola-pvt-t')):
        assert f'(live tensors of the GPU path): this / {base}' in out
        for impl in ('fast', 'fused', 'triton'):
            assert re.search(rf'^{name}\s+{impl}\s+64x96: operations [\d.]+x \(\d+ / \d+\); '
                             rf'bytes [\d.]+x; memory [\d.]+x', out, re.M), \
                (name, impl, out[-3000:])


def test_training_steps_of_the_fused_cores(tmp_path):
    """``train_fused``: the torch and fused cores of the three linear backbones against the
    stock ones at batch 8 under bf16, counted on ``meta`` here."""
    argv = printed()['train_fused']
    assert argv[argv.index('--batch') + 1] == '8' and argv[argv.index('--dtype') + 1] == 'bf16'
    assert argv[argv.index('--impls') + 1:argv.index('--compare')] == ['fast', 'fused']
    out = run(override(argv, device='meta', sizes='64x96', warmup='0', repeats='1'), tmp_path)
    for base, name in (('swin-t', 'pola-swin-t'), ('swin-t', 'nalaformer-t'),
                       ('pvt-t', 'pola-pvt-t')):
        assert f'(live tensors of the GPU path): this / {base}' in out
        for impl in ('fast', 'fused'):
            assert re.search(rf'^{name}\s+{impl}\s+64x96: operations [\d.]+x', out, re.M), \
                (name, impl, out[-3000:])


def test_training_profile(tmp_path):
    argv = printed()['train_profile']
    assert argv[argv.index('--batch') + 1] == '8' and argv[argv.index('--dtype') + 1] == 'bf16'
    assert argv[argv.index('--impls') + 1:argv.index('--impls') + 3] == ['fast', 'fused']
    # the fused core's kernels run on CUDA: here the torch cores
    out = run(override(argv, device='cpu', dtype='fp32', sizes='64x96', batch='1', repeats='1',
                       warmup='0', impls=['fast']), tmp_path)
    for name in ('swin-t | -', 'pola-swin-t | fast', 'nalaformer-t | fast', 'pvt-t | -',
                 'pola-pvt-t | fast'):
        assert f'# profile of {name}, 3 calls, 64x96:' in out, (name, out[-3000:])


@pytest.mark.parametrize('part', ['infer_b8', 'infer_b1'])
def test_inference(part, tmp_path):
    out = run(override(printed()[part], device='cpu', dtype='fp32', sizes='64x96',
                       batch='1', warmup='0', repeats='1'), tmp_path)
    for base, name in (('swin-t', 'pola-swin-t'), ('swin-t', 'nalaformer-t'),
                       ('pvt-t', 'pola-pvt-t')):
        assert f'# time ratios: {base} / this' in out
        for impl in ('fast', 'torch'):
            assert re.search(rf'^{name}\s.*\b{impl}\b', out, re.M), (name, impl, out[-3000:])


@pytest.mark.parametrize('part', ['pola_core', 'nala_core', 'pola_core64', 'nala_core64'])
def test_cores(part, tmp_path):
    """The Triton kernels need CUDA (their interpreter runs are in tests/kernels): here the torch
    Function against the reference, forward and backward."""
    out = run(override(printed()[part], device='cpu', dtype='fp32', grid='8x8', batch='1',
                       impls=['torch', 'reference'], compare='reference', warmup='0',
                       repeats='1'), tmp_path)
    assert re.search(r'^  torch vs reference: [\d.]+x$', out, re.M), out[-3000:]
    heads, dims = ('h1', 'd64') if part.endswith('64') else ('h3', 'd32')
    assert f'-core-{heads}-{dims}-train reference B1 8x8 fp32' in out, out[-3000:]
    # the profile of each core after the measurements (here of CPU operations)
    for impl in ('torch', 'reference'):
        assert f'# profile of {impl}, 5 calls, 8x8:' in out


def test_mask_rcnn(tmp_path):
    argv = printed()['maskrcnn']
    assert argv[argv.index('--impls') + 1:argv.index('--impls') + 4] == ['fast', 'fused', 'triton']
    assert argv[argv.index('--mmcv-ops') + 1] == 'mmcv'
    res = script('--print', 'maskrcnn', MMCV_OPS='torchvision')  # an mmcv without CUDA ops
    assert ' --mmcv-ops torchvision ' in res.stdout
    # the Triton cores train on CUDA only: here the torch core
    out = run(override(argv, device='cpu', sizes='128x192', batch='1', warmup='0', repeats='1',
                       impls=['fast']), tmp_path)
    assert f'# time ratios: {STOCK_MRCNN} / this' in out
    for ours in ('configs/polaformer/mask-rcnn_pola-swin-t_fpn_1x_coco.py',
                 'configs/nalaformer/mask-rcnn_nalaformer-t_fpn_1x_coco.py'):
        assert re.search(rf'^{re.escape(ours)}\s.*\b[\d.]+x\b', out, re.M), out[-3000:]


STAND_IN = '''#!/usr/bin/env bash
# a stand-in for a Python with a GPU: the checks pass, the parts do what their flags ask
if [ "$1" = "-c" ]; then exit 0; fi
if [ "$1" = "-" ]; then cat > /dev/null; echo "stand-in GPU"; exit 0; fi
case "$*" in
  *"--attn pola"*) echo "pola part"; exit 3 ;;
  *"--batch 1 "*) echo "started" > "$STAND_IN_STARTED"; sleep 30; exit 0 ;;
  *) echo "ran: $*"; exit 0 ;;
esac
'''


def _stand_in(tmp_path):
    py = tmp_path / 'python'
    py.write_text(STAND_IN)
    py.chmod(0o755)
    return str(py)


def test_run_loop_with_a_stand_in_python(tmp_path):
    """The parts in order, each with its log; a failed part and one past its limit reported at
    the end while the others run; the first failure's status; the output folder taken from the
    caller's directory, not the repository's; bad limits and a missing Python refused."""
    py, cwd = _stand_in(tmp_path), tmp_path / 'here'
    cwd.mkdir()
    res = subprocess.run(['bash', os.path.abspath(SCRIPT), 'out', 'tests', 'pola_core',
                          'train_b1', 'nala_core'], cwd=cwd, capture_output=True, text=True,
                         env={**os.environ, 'PYTHON': py, 'PART_LIMIT': '2',
                              'STAND_IN_STARTED': str(tmp_path / 'started')})
    out = cwd / 'out'
    assert res.returncode == 3, res.stdout + res.stderr
    assert sorted(p.name for p in out.iterdir()) == [
        'machine.txt', 'nala_core.log', 'pola_core.log', 'tests.log', 'train_b1.log']
    assert (out / 'machine.txt').read_text() == 'stand-in GPU\n'
    assert (out / 'nala_core.log').read_text().startswith('ran: tools/benchmark.py --mode core '
                                                         '--attn nala --backward')
    assert f'--json {out}/nala_core.json' in (out / 'nala_core.log').read_text()
    assert res.stdout.splitlines()[-2:] == ['failed: pola_core (exit status 3)',
                                            'failed: train_b1 (ran past 2 s)']
    for limit in ('x', '0', '15m'):
        res = script(str(tmp_path / 'o2'), 'tests', PYTHON=py, PART_LIMIT=limit)
        assert res.returncode == 2 and 'PART_LIMIT must be a whole number' in res.stderr
    res = script(str(tmp_path / 'o3'), 'tests', PYTHON=str(tmp_path / 'none'))
    assert res.returncode == 2 and "no Python '" in res.stderr
    assert not (tmp_path / 'o2').exists() and not (tmp_path / 'o3').exists()


def test_ctrl_c_stops_the_run(tmp_path):
    py, started = _stand_in(tmp_path), tmp_path / 'started'
    proc = subprocess.Popen(['bash', SCRIPT, str(tmp_path / 'out'), 'train_b1', 'tests'],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True,
                            env={**os.environ, 'PYTHON': py, 'STAND_IN_STARTED': str(started)})
    for _ in range(200):  # the part is running
        if started.exists():
            break
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C sends
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 130, out + err
    assert err.startswith('gpu_benchmarks.sh: stopped (Ctrl-C)')  # by the part or the trap
    assert not (tmp_path / 'out' / 'tests.log').exists()


def test_fused_forms_profile(tmp_path):
    """profile_fused: NaLaFormer-T's and Pola-Swin-T's bf16 steps at batch 8 on the fused forms
    under the profiler; the fused kernels need CUDA, so here the same command on the torch
    cores."""
    argv = printed()['profile_fused']
    assert argv[argv.index('--mode') + 1:argv.index('--device')] == ['train', 'nalaformer-t',
                                                                      'pola-swin-t']
    assert argv[argv.index('--batch') + 1] == '8' and argv[argv.index('--dtype') + 1] == 'bf16'
    assert argv[argv.index('--impls') + 1:argv.index('--profile')] == ['fused']
    assert argv[argv.index('--profile') + 1] == '3'
    out = run(override(argv, device='cpu', dtype='fp32', sizes='64x96', batch='1', repeats='1',
                       warmup='0', impls=['fast']), tmp_path)
    for name in ('nalaformer-t | fast', 'pola-swin-t | fast'):
        assert f'# profile of {name}, 3 calls, 64x96:' in out, (name, out[-3000:])


@pytest.mark.parametrize('part, launch', [('fused_w8', [8, 2048]), ('fused_e1024', [4, 1024])])
def test_fused_forms_launched_another_way(part, launch, tmp_path):
    """fused_w8, fused_e1024: NaLaFormer-T's and Pola-Swin-T's bf16 steps at batch 8 on the fused
    forms with their kernels launched another way, against the stock Swin-T, one step profiled;
    counted on ``meta`` here (without the profile, which needs a device that computes)."""
    argv = printed()[part]
    assert argv[argv.index('--mode') + 1:argv.index('--device')] == [
        'train', 'swin-t', 'nalaformer-t', 'pola-swin-t']
    assert argv[argv.index('--batch') + 1] == '8' and argv[argv.index('--dtype') + 1] == 'bf16'
    assert argv[argv.index('--impls') + 1:argv.index('--fused-launch')] == ['fused']
    assert argv[argv.index('--fused-launch') + 1] == f'{launch[0]}:{launch[1]}'
    assert argv[argv.index('--profile') + 1] == '1'
    i = argv.index('--profile')
    argv = argv[:i] + argv[i + 2:]
    out = run(override(argv, device='meta', sizes='64x96', warmup='0', repeats='1'), tmp_path)
    for name in ('nalaformer-t', 'pola-swin-t'):
        assert re.search(rf'^{name}\s+fused\s+64x96: operations [\d.]+x', out, re.M), \
            (name, out[-3000:])
    with open(tmp_path / 'out.json') as f:
        assert json.load(f)['args']['fused_launch'] == launch
