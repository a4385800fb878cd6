"""``harness.run_python`` forks the tools from ``tests/forkserver.py`` (the large libraries imported
once); a run there must be what a fresh ``python`` process gives: the same exit status, output and
error output for scripts and modules that exercise what a process is (its arguments, import path,
working directory, environment, stdin, exit paths, threads, atexit)."""
import os
import subprocess
import sys
import textwrap

import pytest
from harness import _FORK_SERVERS, run_python

SCRIPT = textwrap.dedent('''\
    import atexit, os, sys, threading, time
    import numpy as np
    print('argv', sys.argv)
    print('path0', sys.path[0])
    print('cwd', os.getcwd())
    print('name', __name__, os.path.basename(__file__))
    print('env', os.environ.get('PROBE_VALUE'))
    print('stdin', repr(sys.stdin.read()))
    MARK = 'the script'
    print('main', sys.modules['__main__'].MARK)
    print('blas', float(np.ones((300, 300)) @ np.ones(300) @ np.ones(300)))
    atexit.register(lambda: print('atexit ran'))
    def late():
        time.sleep(0.2)
        print('thread joined')
    threading.Thread(target=late).start()
    how = sys.argv[1]
    print('to stderr', file=sys.stderr)
    if how == 'code':
        sys.exit(3)
    if how == 'message':
        sys.exit('a message to stderr')
    if how == 'raise':
        raise ValueError('no such thing')
    ''')

MODULE = textwrap.dedent('''\
    import sys
    print('argv', sys.argv[1:], 'path0', sys.path[0], 'name', __name__)
    ''')


@pytest.fixture
def scripts(tmp_path):
    (tmp_path / 'tool.py').write_text(SCRIPT)
    pkg = tmp_path / 'probepkg'
    pkg.mkdir()
    (pkg / '__init__.py').write_text('')
    (pkg / 'cli.py').write_text(MODULE)
    work = tmp_path / 'work'
    work.mkdir()
    return tmp_path, work


def _real(args, cwd, env):
    return subprocess.run([sys.executable] + args, cwd=cwd, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONUNBUFFERED='1', **env), timeout=120)


@pytest.mark.parametrize('how', ['ok', 'code', 'message', 'raise'])
def test_a_forked_run_is_a_fresh_process_run(scripts, how, monkeypatch):
    root, work = scripts
    monkeypatch.setenv('PROBE_VALUE', 'from the environment')
    args = [str(root / 'tool.py'), how]
    forked = run_python(args, cwd=str(work))
    assert _FORK_SERVERS.server(args, dict(os.environ, PYTHONUNBUFFERED='1')).ready  # forked
    real = _real(args, str(work), {})
    assert forked.returncode == real.returncode == {'ok': 0, 'code': 3, 'message': 1,
                                                    'raise': 1}[how]
    assert forked.stdout == real.stdout
    assert 'atexit ran' in real.stdout and 'thread joined' in real.stdout
    assert "env from the environment\nstdin ''\nmain the script\nblas 90000.0\n" in real.stdout
    assert f'path0 {root}\ncwd {work}\n' in real.stdout
    if how == 'raise':  # the same traceback, less the frames of runpy and the server
        def script_frames(err):
            lines = err.splitlines()
            return [line for line in lines if 'tool.py' in line] + lines[-1:]
        assert script_frames(forked.stderr) == script_frames(real.stderr) == [
            f'  File "{root / "tool.py"}", line 24, in <module>', 'ValueError: no such thing']
    else:
        assert forked.stderr == real.stderr


def test_a_module_runs_as_with_dash_m(scripts):
    root, _ = scripts
    args = ['-m', 'probepkg.cli', '--flag', 'x']
    forked, real = run_python(args, cwd=str(root)), _real(args, str(root), {})
    assert forked.returncode == real.returncode == 0, forked.stderr
    assert forked.stdout == real.stdout == f"argv ['--flag', 'x'] path0 {root} name __main__\n"


def test_an_environment_is_the_one_its_libraries_were_imported_under(scripts, tmp_path):
    """A run in another environment gets a server started in that environment (torch reads its
    thread count when imported), and the servers of the last two environments are kept;
    interpreter options get a real process."""
    (tmp_path / 'threads.py').write_text('import torch\nprint(torch.get_num_threads())\n')
    args = [str(tmp_path / 'threads.py')]
    env = {n: dict(os.environ, PYTHONUNBUFFERED='1', OMP_NUM_THREADS=n) for n in ('1', '2')}
    servers = {}
    for n in ('1', '2', '1'):
        forked = run_python(args, env=dict(OMP_NUM_THREADS=n))
        server = _FORK_SERVERS.server(args, env[n])  # the one that ran it: the last used
        assert server.env['OMP_NUM_THREADS'] == n and servers.setdefault(n, server) is server
        assert forked.stdout == _real(args, None, dict(OMP_NUM_THREADS=n)).stdout == f'{n}\n'
    assert _FORK_SERVERS.server(['-X', 'importtime'] + args, env['1']) is None
    res = run_python(['-X', 'importtime'] + args)
    assert res.returncode == 0 and 'import time:' in res.stderr


def test_a_run_past_its_time_is_killed(scripts, tmp_path):
    (tmp_path / 'slow.py').write_text('import time\ntime.sleep(60)\n')
    with pytest.raises(subprocess.TimeoutExpired):
        run_python([str(tmp_path / 'slow.py')], timeout=1)
    assert run_python([str(scripts[0] / 'tool.py'), 'ok']).returncode == 0  # still serving
