"""pytest fixtures and hooks: demo data, the temporary directory of the tools the tests start,
dropping checkpoints when a test ends, the markers of the test folders (``tests/e2e``: ``e2e``
and ``slow``), and mmengine's repeated lookups kept (tests/lookups.py). The harness is in
tests/harness.py, the oracles in tests/oracles/."""
import gc
import os
import os.path as osp

import pytest
from harness import REPO, drop_checkpoints
from lookups import keep_config_and_env_lookups


def pytest_collection_finish(session):
    """In a process that runs tests (a worker, not pytest-xdist's controller, which collects
    nothing): mmengine's repeated lookups kept, then the objects alive (the imported libraries,
    mostly) frozen out of the garbage collector's scans, so that a full collection (mmengine's
    datasets run one per dataset built) walks only what the tests made (0.43 s a scan in a worker
    that had trained a few configs, before)."""
    keep_config_and_env_lookups()
    gc.collect()
    gc.freeze()


@pytest.fixture(scope='session', autouse=True)
def session_tmpdir(tmp_path_factory):
    """Temporary files of this process and of the tools it starts (torchrun's rendezvous
    directories, pip builds) go under pytest's base directory, which pytest.ini's retention
    policy removes, instead of accumulating in the system's /tmp."""
    import tempfile
    path = str(tmp_path_factory.mktemp('tmpdir'))
    saved = os.environ.get('TMPDIR'), tempfile.tempdir
    os.environ['TMPDIR'], tempfile.tempdir = path, path
    yield path
    if saved[0] is None:
        os.environ.pop('TMPDIR', None)
    else:
        os.environ['TMPDIR'] = saved[0]
    tempfile.tempdir = saved[1]


@pytest.fixture(scope='session')
def demo_data():
    """The demo data under the repository's data/demo (the demo overlay's standard data root).
    Generated once; a file lock keeps parallel test workers from writing it at the same time."""
    from filelock import FileLock

    from linattn_mm.demo import make_demo_data
    root = osp.join(REPO, 'data', 'demo')
    os.makedirs(root, exist_ok=True)
    with FileLock(osp.join(root, '.generate.lock')):
        return make_demo_data(root, progress=False)


@pytest.fixture(scope='session')
def fast_config_text():
    """mmengine's Runner pretty-prints the whole config with yapf about nine times per run (for
    its log and the config dump), which costs more than a one-iteration run itself. In the
    in-process harness the text is logged unformatted; training and evaluation are unaffected."""
    from mmengine.config import config as mm_config
    orig = mm_config.FormatCode
    mm_config.FormatCode = lambda text, *args, **kwargs: (text, False)
    yield
    mm_config.FormatCode = orig


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item):
    """A test's checkpoints go when it ends, passed or failed: a failed run keeps its logs for
    inspection, and a cascade of failures cannot fill the disk with checkpoints (pytest.ini
    removes a passed test's whole tmp_path)."""
    tmp = getattr(item, 'funcargs', {}).get('tmp_path')
    if tmp is not None and osp.isdir(tmp):
        drop_checkpoints(str(tmp))
    return (yield)



def pytest_collection_modifyitems(config, items):
    """Every test under tests/e2e/ (the tools run on configs and demo data: training, testing,
    packaging, the documented commands) is marked ``e2e`` and ``slow``; ``pytest -m "not slow"``
    runs the kernels, models and checkpoint tests."""
    e2e = osp.join(REPO, 'tests', 'e2e') + os.sep
    for item in items:
        if str(item.fspath).startswith(e2e):
            item.add_marker(pytest.mark.e2e)
            item.add_marker(pytest.mark.slow)
