"""The suite's disk hygiene: checkpoints written under a test's tmp_path are deleted when the test
ends (tests/conftest.py), and pytest.ini keeps only failed tests' directories."""
import configparser
import os
import os.path as osp

from harness import REPO, drop_checkpoints


def test_drop_checkpoints_keeps_logs_and_configs(tmp_path):
    work = tmp_path / 'work' / '20261122_000000'
    work.mkdir(parents=True)
    (tmp_path / 'work' / 'epoch_1.pth').write_bytes(b'\0' * 1000)
    (tmp_path / 'work' / 'iter_2.pt').write_bytes(b'\0' * 10)
    (tmp_path / 'work' / 'last_checkpoint').write_text('epoch_1.pth')
    (work / 'run.log').write_text('loss: 1.0')
    (work / 'config.py').write_text('x = 1')
    os.symlink(tmp_path / 'work' / 'epoch_1.pth', tmp_path / 'work' / 'latest.pth')
    freed = drop_checkpoints(str(tmp_path))
    assert freed == 1010
    left = sorted(osp.relpath(osp.join(d, f), tmp_path) for d, _, fs in os.walk(tmp_path)
                  for f in fs)
    assert left == ['work/20261122_000000/config.py', 'work/20261122_000000/run.log',
                    'work/last_checkpoint']


def test_pytest_ini_keeps_only_failed_tests_directories():
    ini = configparser.ConfigParser()
    ini.read(osp.join(REPO, 'pytest.ini'))
    assert ini['pytest']['tmp_path_retention_policy'] == 'failed'
    assert int(ini['pytest']['tmp_path_retention_count']) == 1


def test_temporary_files_go_under_pytest_base_directory(session_tmpdir, tmp_path_factory):
    import subprocess
    import sys
    import tempfile
    base = str(tmp_path_factory.getbasetemp())
    assert session_tmpdir.startswith(base)
    assert tempfile.gettempdir() == session_tmpdir
    out = subprocess.run([sys.executable, '-c', 'import tempfile; print(tempfile.gettempdir())'],
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out == session_tmpdir
