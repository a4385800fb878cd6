"""The test harness: the repository's paths, running the tools (in a subprocess or in this
process), short-run options for any config, the demo form of a config, spying on calls, and the
check that a converted module refuses calls that are not inference calls."""
import atexit
import glob
import json
import math
import os
import os.path as osp
import runpy
import select
import signal
import subprocess
import sys
import tempfile

import pytest

REPO = osp.dirname(osp.dirname(osp.abspath(__file__)))  # tests/harness.py -> the repository
CONFIGS = osp.join(REPO, 'configs')
CHECKPOINT_SUFFIXES = ('.pth', '.pt', '.safetensors')


def all_configs():
    """The configs of ``configs/`` (not the ``_base_`` files), as repository-relative paths with
    ``/``."""
    paths = glob.glob(osp.join(CONFIGS, '**', '*.py'), recursive=True)
    rel = {osp.relpath(p, REPO).replace(os.sep, '/') for p in paths}
    return {p for p in rel if '_base_' not in p.split('/')}


def released_backbones(dense_only=False):
    """The distinct backbone configs of ``configs/`` (without their pretrained weights), as
    (first config path, backbone config) pairs; ``dense_only``: those of detectors and segmentors
    (configs whose model has a neck or a decode head)."""
    from mmengine.config import Config
    seen = {}
    for path in sorted(all_configs()):
        model = Config.fromfile(osp.join(REPO, path)).get('model', {})
        backbone = model.get('backbone')
        dense = 'neck' in model or 'decode_head' in model
        if backbone is not None and (dense or not dense_only):
            backbone = {k: v for k, v in backbone.items() if k != 'init_cfg'}
            seen.setdefault(repr(sorted(backbone.items())), (path, backbone))
    return list(seen.values())


def drop_checkpoints(root):
    """Delete checkpoint files under ``root`` (logs, configs and results stay); returns the
    number of bytes freed."""
    freed = 0
    for dirpath, _, files in os.walk(root):
        for name in files:
            if name.endswith(CHECKPOINT_SUFFIXES):
                path = osp.join(dirpath, name)
                if osp.islink(path):
                    os.unlink(path)
                    continue
                freed += osp.getsize(path)
                os.remove(path)
    return freed


def record_calls(monkeypatch, owner, name):
    """Replace ``owner.name`` (a function, or a method when ``owner`` is a class) by a wrapper that
    still runs it and records the shape of its first tensor argument; returns the list of
    shapes."""
    import torch
    calls, real = [], getattr(owner, name)

    def spy(*args, **kwargs):
        calls.append(next(tuple(a.shape) for a in args if isinstance(a, torch.Tensor)))
        return real(*args, **kwargs)
    monkeypatch.setattr(owner, name, spy)
    return calls


def triton_interpret_checks(which):
    """Run tests/kernels/triton_interpret_checks.py for ``which`` ('pola' or 'nala') in a subprocess with
    ``TRITON_INTERPRET=1`` (the Triton kernels on CPU tensors); returns its case -> relative
    error dict."""
    tests = osp.join(REPO, 'tests')  # the script imports the oracles
    env = dict(os.environ, TRITON_INTERPRET='1', PYTHONWARNINGS='ignore',
               PYTHONPATH=os.pathsep.join(p for p in (tests, os.environ.get('PYTHONPATH')) if p))
    out = subprocess.run([sys.executable, osp.join(REPO, 'tests', 'kernels', 'triton_interpret_checks.py'),
                          which], env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


#: a NaLa gradient stored in bfloat16 / float16: within its rounding (Triton's interpreter
#: converts float32 to bfloat16 by truncation, one unit in the last place; compiled kernels round
#: to nearest); float32: 1e-5
NALA_HALF_TOL = {'bf16': 2 ** -7 + 1e-5, 'fp16': 2 ** -11 + 1e-5}


def assert_nala_core_grads(results):
    """The ``grad ...`` entries of ``triton_interpret_checks('nala-grad')`` (or
    ``'nala-fused'``): eight cases, the output and q, k, v each, within 1e-5 of the float64
    reference, half-precision gradients within their rounding."""
    core = {k: v for k, v in results.items() if k.startswith('grad ')}
    assert len(core) == 32  # 8 cases: the output and q, k, v
    for name, err in core.items():
        half = next((t for t in NALA_HALF_TOL if f' {t} ' in name), None)
        tol = NALA_HALF_TOL[half] if half and not name.endswith(': out') else 1e-5
        assert err < tol, f'{name}: relative error {err:.3g}'


def _nala_steps(results):
    steps = {k: v for k, v in results.items() if k.startswith('train ')}
    assert len(steps) == 4
    baseline = steps.pop('train NaLaFormer backbone, with_cp, torch core (baseline)')
    assert baseline < 1e-4
    return steps, baseline


def assert_nala_module_steps(results):
    """The ``train nala module ...`` entries of the same checks: training steps of NaLa modules
    (with and without RoPE, lam 2) within 1e-5 of the float64 reference cores: the output, the
    input's and every parameter's gradient."""
    steps, _ = _nala_steps(results)
    modules = {k: v for k, v in steps.items() if 'backbone' not in k}
    assert len(modules) == 2
    for name, err in modules.items():
        assert err < 1e-5, f'{name}: relative error {err:.3g}'


def assert_nala_network_step(results):
    """The whole NaLaFormer (NaLa in every stage, activation checkpointing) within 1.5x the
    float32 error of the same network on the default torch core (or 1e-5)."""
    steps, baseline = _nala_steps(results)
    (name, err), = [(k, v) for k, v in steps.items() if 'backbone' in k]
    assert err < max(1e-5, 1.5 * baseline), \
        f'{name}: relative error {err:.3g} (torch core: {baseline:.3g})'


def assert_nala_calls_in_situ(results, core):
    """The ``in situ call ...`` entries of the same checks: each NaLa core call of the network
    step above (four, one per stage), on the inputs and the upstream gradient it got in the
    float32 network, run by ``core`` (``'triton'`` or ``'fused'``), by the torch core and by
    the float32 reference core, each against the float64 oracle (the largest relative error over
    the output and the gradients of q, k, v). The kernel's error is within 4e-6 at every call
    (over nine input images the three float32 cores all stayed under 3e-6), and over the calls
    its geometric mean ratio to the larger of the torch core's and the float32 reference's is at
    most 1.5 (nine images: 0.71 for the Triton core, 0.86 for the fused core; single calls
    0.2-2.5x, the luck of rounding at this size)."""
    calls = {}
    for key, err in results.items():
        if key.startswith('in situ call '):
            i, name = key[len('in situ call '):].split(': ')
            calls.setdefault(int(i), {})[name] = err
    assert sorted(calls) == [0, 1, 2, 3], sorted(calls)
    logs = []
    for i, errs in sorted(calls.items()):
        assert set(errs) == {core, 'fast', 'reference'}, errs
        assert errs[core] < 4e-6, f'call {i}: {core} core relative error {errs[core]:.3g}'
        logs.append(math.log(errs[core] / max(errs['fast'], errs['reference'])))
    ratio = math.exp(sum(logs) / len(logs))
    assert ratio <= 1.5, f'{core} core: geometric mean error ratio {ratio:.3g} over the calls'


#: A known shortfall of the whole-network checks of the NaLa Triton kernels (the Triton and fused
#: cores, and the fused conv sums of NaLaFormer blocks), run by Triton's interpreter: whole
#: NaLaFormers' float32 training steps miss their bounds on AVX2 CPUs and meet them on AVX-512
#: CPUs. Measured on a 2-core AVX2 EPYC: the Triton core 3.4e-5 and the fused core 1.8e-5 against
#: 1.5x the torch core's 1.1e-5; the fused conv sums (mixers on the torch core) 1.24e-5 against
#: 1e-5. The kernels are not the cause as far as measured: the largest error is stage 1's
#: ``qkvg.bias`` gradient, a sum over the tokens with much cancellation, and on its own inputs
#: rounded from the float64 network stage 1's mixer on the Triton core is closer to float64 than
#: on the torch core (2.0e-6 against 4.8e-6 for that bias). Fed the float32 network's inputs (its
#: upstream gradient 4e-6 off float64), plain float32 autograd of the reference core misses by
#: 1.0e-5 to 1.8e-5. Over eight input images (version 0.6.21) the network errors range 0.4-4.3x
#: the torch core's (Triton core), 0.7-3.6x (fused core), and 0.5-3.3x for the float32 reference
#: core itself: one image's 1.5x bound tests the conditioning of the step more than the kernels.
#: Against the larger of the two float32 errors (torch core, reference core) of the same image
#: the Triton core's is 0.42-1.31x (median 0.78), the fused core's 0.47-3.6x (median 0.99). The
#: 3.6x (9.4e-5, one image) is the network, not the kernel: on that image's own NaLa calls (their
#: inputs and upstream gradients in the float32 network) the fused core is 0.54-0.93x the torch
#: core's error, and random relative perturbations of 1e-7 at the cores' inputs, outputs and
#: gradients (below the cores' own float32 error, 3e-7 to 3e-6) give that image's network errors
#: of 2.6e-5 to 1.0e-4 over eight draws (3e-7: 4.0e-5 to 9.2e-5). One block shows it too: the
#: released layout's stage-1 block on its own input and upstream gradient has 2.8x its default
#: form's error on its fused forms, in the gradients that are sums over the tokens (``qkvg.bias``
#: 1.9e-5 against 4.4e-6, the first LayerNorm's and CPE's biases), and as much with only the
#: fused core's forward output put into the default form (the Triton core's: the same);
#: Gaussian noise of 7e-8 to 1.5e-7 of the output's largest value on that output gives errors
#: of 2.7e-6 to 3.4e-5 there, most of the effect from the map's last row. What the kernels add
#: is checked where the network calls them (:func:`assert_nala_calls_in_situ`). Not strict:
#: AVX-512 CPUs pass.
NALA_NETWORK_FLOAT32_SHORTFALL = pytest.mark.xfail(
    strict=False, reason='NaLa Triton kernels: a whole NaLaFormer\'s float32 error misses its '
    'bound on AVX2 CPUs (up to 3x the torch core\'s, 1.5x asserted; the float32 reference core '
    'varies as much over inputs); see harness.NALA_NETWORK_FLOAT32_SHORTFALL')


class _ForkServer:
    """One ``tests/forkserver.py`` process, started with the environment ``env``."""

    def __init__(self, env):
        self.env, self.pending = env, b''
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([sys.executable, osp.join(REPO, 'tests', 'forkserver.py')],
                                     cwd=REPO, env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log)
        atexit.register(self.stop)
        self.ready = bool((self._reply(timeout=600) or {}).get('ready'))
        if not self.ready:
            self.stop()

    def _reply(self, timeout=None):
        """The server's next reply (a dict; ``{}`` when it has exited), None after ``timeout``
        seconds without one."""
        fd = self.proc.stdout.fileno()
        while b'\n' not in self.pending:
            if not select.select([fd], [], [], timeout)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                return {}
            self.pending += chunk
        line, self.pending = self.pending.split(b'\n', 1)
        return json.loads(line)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)

    def run(self, args, cwd, env, timeout):
        with tempfile.TemporaryDirectory() as tmp:
            paths = [osp.join(tmp, 'stdout'), osp.join(tmp, 'stderr')]
            req = dict(argv=list(args), cwd=str(cwd), env=env, stdout=paths[0], stderr=paths[1])
            self.proc.stdin.write((json.dumps(req) + '\n').encode())
            self.proc.stdin.flush()
            pid = self._reply().get('pid')
            if pid is None:  # the server is gone: a bug of the harness, not of the tool
                self.log.seek(0)
                raise RuntimeError('tests/forkserver.py exited: '
                                   + self.log.read()[-3000:].decode(errors='replace'))
            done = self._reply(timeout)
            if done is None:
                os.kill(pid, signal.SIGKILL)
                self._reply()
                raise subprocess.TimeoutExpired([sys.executable] + list(args), timeout)
            out = [open(p, encoding='utf-8', errors='replace').read() for p in paths]
        return subprocess.CompletedProcess([sys.executable] + list(args), done['rc'], *out)


class _ForkServers:
    """The servers of this test process, one per environment a run asked for (a server's
    libraries were imported under its environment, and read some variables then), started on
    first use, at most ``KEEP`` at a time (the least recently used stopped first), stopped at
    exit."""

    KEEP = 2
    #: variables that change from test to test and that no preloaded library reads
    VOLATILE = ('PYTEST_CURRENT_TEST',)

    def __init__(self):
        self.servers, self.failed = {}, False

    def server(self, args, env):
        """The server that runs ``python ARGS`` with ``env`` as a fresh process would, or None
        for interpreter options (they need an interpreter of their own), with
        ``LINATTN_TEST_FORKSERVER=0`` or where a server could not start."""
        if os.environ.get('LINATTN_TEST_FORKSERVER', '1') == '0' or self.failed:
            return None
        if not args or (args[0].startswith('-') and args[0] != '-m'):
            return None
        key = json.dumps({k: v for k, v in env.items() if k not in self.VOLATILE},
                         sort_keys=True)
        server = self.servers.pop(key, None)
        if server is None:
            while len(self.servers) >= self.KEEP:
                self.servers.pop(next(iter(self.servers))).stop()
            server = _ForkServer(env)
            if not server.ready:
                self.failed = True
                return None
        self.servers[key] = server  # the most recently used last
        return server


_FORK_SERVERS = _ForkServers()


def run_python(args, cwd=REPO, timeout=900, env=None):
    """``python ARGS`` as a fresh process would run it (``env``: variables to set there), its
    output captured as text: a ``subprocess.CompletedProcess``. A tool script or module is forked
    from ``tests/forkserver.py``, which has imported the large third-party libraries once
    under the same environment (``LINATTN_TEST_FORKSERVER=0``: always a real subprocess, as for
    interpreter options)."""
    env = dict(os.environ, PYTHONUNBUFFERED='1', **(env or {}))
    server = _FORK_SERVERS.server(args, env)
    if server is not None:
        return server.run(args, cwd, env, timeout)
    return subprocess.run([sys.executable] + list(args), cwd=cwd, capture_output=True, text=True,
                          env=env, timeout=timeout)


def run_tool(args, cwd=REPO, timeout=900, env=None):
    """Run a tool script as a fresh process (:func:`run_python`; ``env``: variables to set there);
    return its output (asserting success)."""
    res = run_python(args, cwd=cwd, timeout=timeout, env=env)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-5000:]
    return out


def metrics_of(out):
    """The metrics dict printed by tools/test.py."""
    line = [ln for ln in out.splitlines() if ln.startswith('linattn_mm metrics: ')][-1]
    return json.loads(line[len('linattn_mm metrics: '):])


def _dataset_path(loader_cfg, key):
    ds, path = loader_cfg['dataset'], f'{key}.dataset'
    while ds.get('type') in ('RepeatDataset', 'ClassBalancedDataset', 'ConcatDataset') and \
            'dataset' in ds:
        ds, path = ds['dataset'], path + '.dataset'
    return path


def short_run_options(cfg):
    """cfg-options for one training iteration on 2 images and a test on 2 images, plus the
    metric keys tools/test.py must report, for any mmdet / mmseg / mmpretrain config."""
    scope = cfg.get('default_scope')
    # no validation during the one-iteration run (the test pass evaluates), no optimizer state in
    # the checkpoint: both only cost time here
    # not serialized (mmengine packs the annotations into one array for worker processes and
    # runs a full garbage collection each time: a second per run; the demo loaders have none)
    train_ds = _dataset_path(cfg.train_dataloader, 'train_dataloader')
    test_ds = _dataset_path(cfg.test_dataloader, 'test_dataloader')
    train = [f'{train_ds}.indices=2', f'{train_ds}.serialize_data=False',
             'train_dataloader.batch_size=2', 'train_cfg.val_begin=100',
             'default_hooks.checkpoint.save_optimizer=False']
    train.append('train_cfg.max_epochs=1' if 'max_epochs' in cfg.train_cfg else
                 'train_cfg.max_iters=1')
    test = [f'{test_ds}.indices=2', f'{test_ds}.serialize_data=False']
    if scope == 'mmdet':
        tc = cfg.model.get('test_cfg', {})
        thr = 'model.test_cfg.rcnn.score_thr=0.0' if 'rcnn' in tc else 'model.test_cfg.score_thr=0.0'
        train.append(thr)
        test.append(thr)
        # few proposals / sampled RoIs: the model is unchanged, the smoke run is much cheaper
        trc = cfg.model.get('train_cfg', {})
        if 'rpn_proposal' in trc:
            train += ['model.train_cfg.rpn_proposal.nms_pre=200',
                      'model.train_cfg.rpn_proposal.max_per_img=64']
        rcnn = trc.get('rcnn')
        if isinstance(rcnn, (list, tuple)):
            train += [f'model.train_cfg.rcnn.{i}.sampler.num=64' for i in range(len(rcnn))]
        elif rcnn is not None:
            train.append('model.train_cfg.rcnn.sampler.num=64')
        if 'rpn' in tc:
            test += ['model.test_cfg.rpn.nms_pre=200', 'model.test_cfg.rpn.max_per_img=64']
        # at most 10 detections an image (not 100): with score_thr 0 every test image has its
        # full quota, and a mask head's four 256-channel convs run on each
        test.append('model.test_cfg.rcnn.max_per_img=10' if 'rcnn' in tc else
                    'model.test_cfg.max_per_img=10')
        metric = cfg.test_evaluator.get('metric', 'bbox')
        metric = [metric] if isinstance(metric, str) else list(metric)
        keys = [f'coco/{m}_mAP' for m in metric]
    elif scope == 'mmseg':
        keys = ['mIoU', 'aAcc']
    elif scope == 'mmpretrain':
        keys = ['accuracy/top1']
    else:
        raise ValueError(f'unexpected default_scope {scope!r}')
    return train, test, keys


_TOOLS = {}


def reset_visualizers():
    """Forget mmengine's process-wide visualizers. The stock configs name theirs 'visualizer', and
    ``get_instance`` returns an existing instance with its old save_dir: a second in-process run
    would write into the first run's (possibly deleted) work directory."""
    from mmengine.visualization import Visualizer
    todo = [Visualizer]
    while todo:
        cls = todo.pop()
        cls._instance_dict.clear()
        todo.extend(cls.__subclasses__())


def tool_main(name):
    """The ``main`` of tools/<name>.py, to run in this process as if it were a fresh one."""
    if name not in _TOOLS:
        _TOOLS[name] = runpy.run_path(osp.join(REPO, 'tools', f'{name}.py'),
                                      run_name=f'linattn_tool_{name}')['main']
    main = _TOOLS[name]

    def fresh_main(*args, **kwargs):
        reset_visualizers()
        return main(*args, **kwargs)
    return fresh_main


def demo_form(config):
    """The config file ``config`` with the demo overlay applied (what ``--demo`` runs)."""
    from mmengine.config import Config

    from linattn_mm.demo import apply_demo
    return apply_demo(Config.fromfile(config))


def train_and_test_inprocess(config, work_dir, demo=False):
    """tools/train.py then tools/test.py (their main functions, in this process) for a short run
    (with ``--demo`` when ``demo``). Returns the test metrics and the metric keys to check."""
    from mmengine.config import Config
    cfg = demo_form(config) if demo else Config.fromfile(config)
    train_opts, test_opts, keys = short_run_options(cfg)
    flags = ['--demo'] if demo else []
    tool_main('train')([config, '--work-dir', work_dir] + flags + ['--cfg-options'] + train_opts)
    with open(osp.join(work_dir, 'last_checkpoint')) as f:
        ckpt = f.read().strip()
    import io
    from contextlib import redirect_stdout
    buf = io.StringIO()
    with redirect_stdout(buf):
        tool_main('test')([config, ckpt, '--work-dir', work_dir] + flags + ['--cfg-options'] +
                          test_opts)
    metrics = metrics_of(buf.getvalue())
    return metrics, keys


def assert_inference_only(module, call, call_float32=None):
    """A converted module (:func:`linattn_mm.deploy.convert`) refuses every call that is not an
    inference call, with an error naming the problem: a gradient needed (``call()`` with grad
    enabled), training mode, and autocast (``call_float32()`` under CPU bfloat16 autocast; the
    module is left in float32 then). ``module`` is in eval mode before and after."""
    import torch
    with pytest.raises(RuntimeError, match='without gradients'):
        call()
    module.train()
    with torch.no_grad(), pytest.raises(RuntimeError, match='training mode'):
        call()
    module.eval()
    if call_float32 is not None:
        with torch.no_grad(), torch.autocast('cpu', dtype=torch.bfloat16), \
                pytest.raises(RuntimeError, match='autocast'):
            call_float32()

