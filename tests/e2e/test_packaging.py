"""The built wheel: it ships every config as ``linattn_mm/.mim/configs`` and the user tools as
``linattn_mm/.mim/tools``, the installed package finds them there (not in a source checkout), and
its metadata version is ``__version__``. Also: the newest CHANGELOG.md entry is the package
version."""
import os
import os.path as osp
import re
import shutil
import subprocess
import sys
import zipfile

import pytest
from harness import CONFIGS, REPO

import linattn_mm
from linattn_mm.tools import LAUNCHERS, TOOLS

# what setup.py reads; copying only these keeps the build off the repository (no build/ or
# egg-info there) and away from data/ and work_dirs/
SOURCES = ['setup.py', 'MANIFEST.in', 'README.md', 'CHANGELOG.md', 'LICENSE', 'linattn_mm',
           'configs', 'tools']
#: the files of tools/ a built package carries as linattn_mm/.mim/tools
SHIPPED_TOOLS = sorted([f'{name}.py' for name in TOOLS] + list(LAUNCHERS))


def _config_files():
    files = []
    for dirpath, dirnames, filenames in os.walk(CONFIGS):
        dirnames[:] = [d for d in dirnames if d != '__pycache__']
        files += [osp.relpath(osp.join(dirpath, f), CONFIGS).replace(os.sep, '/')
                  for f in filenames if not f.endswith('.pyc')]
    return sorted(files)


def _pip_wheel(target, out, cwd):
    res = subprocess.run(
        [sys.executable, '-m', 'pip', 'wheel', str(target), '--no-deps', '--no-build-isolation',
         '--no-index', '--disable-pip-version-check', '-q', '-w', str(out)],
        capture_output=True, text=True, timeout=600, cwd=str(cwd))
    assert res.returncode == 0, (res.stdout + res.stderr)[-5000:]
    wheels = sorted(out.glob('linattn_mm-*.whl'))
    assert len(wheels) == 1, os.listdir(out)
    return wheels[0]


@pytest.fixture(scope='module')
def source_copy(tmp_path_factory):
    src = tmp_path_factory.mktemp('src')
    ignore = shutil.ignore_patterns('__pycache__', '*.pyc', '*.egg-info')
    for name in SOURCES:
        path = osp.join(REPO, name)
        if osp.isdir(path):
            shutil.copytree(path, src / name, ignore=ignore)
        elif osp.isfile(path):
            shutil.copy2(path, src / name)
    return src


@pytest.fixture(scope='module')
def wheel(source_copy, tmp_path_factory):
    return _pip_wheel(source_copy, tmp_path_factory.mktemp('wheelhouse'), source_copy)


@pytest.fixture(scope='module')
def sdist(source_copy, tmp_path_factory):
    """The source distribution (``python setup.py sdist``), built from a copy of the sources."""
    out = tmp_path_factory.mktemp('sdist')
    res = subprocess.run([sys.executable, 'setup.py', '-q', 'sdist', '-d', str(out)],
                         capture_output=True, text=True, timeout=600, cwd=str(source_copy))
    assert res.returncode == 0, (res.stdout + res.stderr)[-5000:]
    found = sorted(out.glob('linattn_mm-*.tar.gz'))
    assert len(found) == 1, os.listdir(out)
    return found[0]


def test_wheel_built_from_the_sdist_ships_every_config(sdist, tmp_path):
    """``python -m build`` (and ``pip install`` of an sdist) builds the wheel from the sdist,
    not from the source tree: the sdist must carry the configs (MANIFEST.in)."""
    import tarfile
    with tarfile.open(sdist) as tf:
        names = tf.getnames()
    top = names[0].split('/')[0]
    in_sdist = {n[len(top) + len('/configs/'):] for n in names
                if n.startswith(f'{top}/configs/') and n.endswith('.py')}
    assert in_sdist == {f for f in _config_files() if f.endswith('.py')}
    assert f'{top}/CHANGELOG.md' in names and not any('__pycache__' in n for n in names)
    assert f'{top}/LICENSE' in names  # setup.py's license, Apache-2.0: its text
    # the user tools, not the repository's maintenance scripts
    assert sorted(n[len(f'{top}/tools/'):] for n in names
                  if n.startswith(f'{top}/tools/')) == SHIPPED_TOOLS
    _assert_ships_every_config(_pip_wheel(sdist, tmp_path, tmp_path))


def test_wheel_ships_every_config(wheel):
    _assert_ships_every_config(wheel)


def _assert_ships_every_config(wheel):
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
    prefix = 'linattn_mm/.mim/configs/'
    shipped = {n[len(prefix):] for n in names if n.startswith(prefix) and not n.endswith('/')}
    shipped = {n for n in shipped if '__pycache__' not in n and not n.endswith('.pyc')}
    expected = set(_config_files())
    assert expected, 'no configs found in the repository'
    missing, extra = sorted(expected - shipped), sorted(shipped - expected)
    assert not missing and not extra, (f'{len(missing)} configs missing from {wheel.name}: '
                                       f'{missing[:20]}; {len(extra)} unexpected: {extra[:20]}')
    assert 'linattn_mm/__init__.py' in names
    assert any(re.fullmatch(r'linattn_mm-[^/]+\.dist-info/METADATA', n) for n in names)
    license_text = [n for n in names
                    if re.fullmatch(r'linattn_mm-[^/]+\.dist-info/(licenses/)?LICENSE', n)]
    assert license_text, 'the wheel carries no LICENSE'
    with zipfile.ZipFile(wheel) as zf:
        assert 'Apache License' in zf.read(license_text[0]).decode()
        # the user tools as they are in tools/, and the console script that runs them
        prefix = 'linattn_mm/.mim/tools/'
        tools = sorted(n[len(prefix):] for n in names if n.startswith(prefix))
        assert tools == SHIPPED_TOOLS, tools
        for name in tools:
            with open(osp.join(REPO, 'tools', name), 'rb') as f:
                assert zf.read(prefix + name) == f.read(), name
        entry_points = [n for n in names
                        if re.fullmatch(r'linattn_mm-[^/]+\.dist-info/entry_points\.txt', n)]
        assert entry_points, 'the wheel declares no console script'
        text = zf.read(entry_points[0]).decode()
        assert re.search(r'^linattn-mm\s*=\s*linattn_mm\.tools:main$', text, flags=re.M), text


PROBE = r'''
import importlib.metadata, json, os.path as osp, sys
import linattn_mm
from linattn_mm.apis import config_root, get_config
from linattn_mm.demo import apply_demo
cfg = get_config('mask-rcnn_pvtv2-b0_fpn_1x_coco')
print(json.dumps(dict(
    package=osp.dirname(osp.abspath(linattn_mm.__file__)),
    root=osp.abspath(config_root()),
    config_file=osp.abspath(cfg.filename),
    scope=cfg.get('default_scope'),
    demo_root=apply_demo(cfg).train_dataloader.dataset.data_root,
    version=linattn_mm.__version__,
    dist_version=importlib.metadata.version('linattn_mm'),
    dist_path=str(importlib.metadata.distribution('linattn_mm')._path),
)))
'''


def _unpacked(wheel, tmp_path):
    """The wheel unpacked into ``tmp_path/site``, an empty working folder and the environment
    of a process that imports it: the unpacked wheel first on sys.path (the editable install's
    path hooks of the venv stay behind it), the repository neither the cwd nor on PYTHONPATH."""
    site = tmp_path / 'site'
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)
    cwd = tmp_path / 'elsewhere'
    cwd.mkdir()
    env = {k: v for k, v in os.environ.items() if k != 'PYTHONPATH'}
    env['PYTHONPATH'] = str(site)
    return site, cwd, env


def _run(args, cwd, env):
    res = subprocess.run([sys.executable, *args], cwd=str(cwd), env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, (res.stdout + res.stderr)[-5000:]
    return res.stdout


def test_unpacked_wheel_finds_its_configs_and_version(wheel, tmp_path):
    site, cwd, env = _unpacked(wheel, tmp_path)
    import json
    info = json.loads(_run(['-c', PROBE], cwd, env).strip().splitlines()[-1])
    site_s = osp.realpath(site)

    def inside(path):
        return osp.realpath(path).startswith(site_s + os.sep)

    assert inside(info['package']), info
    assert inside(info['root']) and info['root'].replace(os.sep, '/').endswith(
        'linattn_mm/.mim/configs'), info
    assert inside(info['config_file']), info
    assert info['scope'] == 'mmdet'
    assert info['demo_root'] == 'data/demo/coco/'  # the demo overlay works from the wheel
    assert inside(info['dist_path']), info
    assert info['dist_version'] == info['version'] == linattn_mm.__version__


TOOL_PROBE = r'''
import json, sys
from linattn_mm.tools import main, tool_path, tools_dir
print(json.dumps(dict(tools=tools_dir(), train=tool_path('train'))))
sys.exit(main(['make_demo_data', '--root', 'demo', '--tasks', 'imagenet']))
'''


def test_unpacked_wheel_runs_its_tools(wheel, tmp_path):
    # python -m linattn_mm.tools TOOL (the console script linattn-mm calls the same main) runs the
    # tools the wheel ships, away from any checkout: the demo data made where the user stands,
    # and the train tool's arguments
    site, cwd, env = _unpacked(wheel, tmp_path)
    import json
    info = json.loads(_run(['-c', TOOL_PROBE], cwd, env).strip().splitlines()[0])
    tools = osp.join(osp.realpath(site), 'linattn_mm', '.mim', 'tools')
    assert osp.realpath(info['tools']) == tools, info
    assert osp.realpath(info['train']) == osp.join(tools, 'train.py'), info
    meta = cwd / 'demo' / 'imagenet' / 'meta'
    assert (meta / 'train.txt').is_file() and (meta / 'val.txt').is_file(), os.listdir(cwd)
    usage = _run(['-m', 'linattn_mm.tools', 'train', '--help'], cwd, env)
    assert usage.startswith('usage: train.py') and '--attn-core' in usage, usage


def test_changelog_newest_version_is_package_version():
    with open(osp.join(REPO, 'CHANGELOG.md'), encoding='utf-8') as f:
        text = f.read()
    heads = re.findall(r'^##\s+\[?v?(\d+\.\d+\.\d+[^\]\s]*)\]?', text, flags=re.M)
    assert heads, 'CHANGELOG.md has no "## <version>" heading'
    assert heads[0] == linattn_mm.__version__, (heads[0], linattn_mm.__version__)
