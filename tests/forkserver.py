"""A process that imports the large third-party libraries once and forks a child for each run of a
Python tool, so that a test running ``python tools/X.py ...`` does not pay their import again
(torch, mmengine, mmcv, torchvision, matplotlib, pycocotools: about 8 s of CPU per process on a
2-core machine; the doc commands alone start about sixty such processes).

Used by ``harness.run_python``, which starts a server with the environment of the run (another
server for another environment, the last two kept: the libraries read some variables when
imported) and runs a real subprocess where a server cannot give the same run (interpreter
options, a server that could not start); ``LINATTN_TEST_FORKSERVER=0`` turns it off. The child
runs like ``python SCRIPT ARGS`` (or ``python -m MODULE ARGS``): ``sys.argv``, ``sys.path[0]``,
the working directory, the environment, stdin from /dev/null, stdout and stderr to the files of
the request; an uncaught exception prints its traceback and exits 1, ``SystemExit`` exits as the
interpreter does, threads are joined and atexit functions run before the child exits.

Before it serves, the server also parses the metafiles mmengine reads to resolve the
``mmdet::`` / ``mmseg::`` / ``mmpretrain::`` bases of a config, once (``tests/lookups.py``), and
freezes the objects alive then out of the garbage collector's scans, so that every child finds
them done.

What it does not preload: mmdet, mmseg, mmpretrain and linattn_mm (their imports register models
and transforms; a tool must import them itself, as it does on a user's machine). The server only
forks while the only threads besides its own are OpenBLAS's idle pools (``BLAS_POOLS``; a fork of
a multi-threaded process may inherit a held lock); otherwise it says so and the caller runs real
subprocesses.

Protocol (one JSON object per line): the server writes ``{"ready": true}`` (or ``{"unavailable":
reason}``) after its imports, then for each request ``{"argv": [...], "cwd": ..., "env": {...},
"stdout": path, "stderr": path}`` read from stdin it writes ``{"pid": n}`` after the fork and
``{"rc": n}`` when the child has exited (``-N`` for a child killed by signal N, as ``subprocess``
reports it).
"""
import atexit
import gc
import importlib
import json
import os
import os.path as osp
import runpy
import sys
import threading

PRELOAD = ['numpy', 'torch', 'torchvision', 'cv2', 'matplotlib.pyplot', 'scipy', 'pycocotools.coco',
           'mmengine', 'mmengine.model', 'mmengine.runner', 'mmcv', 'mmcv.cnn', 'mmcv.ops',
           'mmcv.transforms']

#: modules whose import starts the idle thread pool of the OpenBLAS they bundle (numpy's, and
#: OpenCV's own copy): OpenBLAS stops its pool before a fork (``pthread_atfork``) and the child
#: starts its own on first use, so these threads do not make a fork unsafe
BLAS_POOLS = {'numpy', 'cv2'}


def _threads():
    try:
        return len(os.listdir('/proc/self/task'))
    except OSError:  # pragma: no cover - not Linux
        return threading.active_count()


def _exit_code(code):
    """The exit status of ``SystemExit(code)``, its message printed as the interpreter prints it."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    try:
        print(code, file=sys.stderr)
    except Exception:  # pragma: no cover
        pass
    return 1


def _child(req, proto_in, proto_out):
    """Become ``python ARGV`` (never returns)."""
    rc = 1
    try:
        os.close(proto_in)
        os.close(proto_out)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, path in ((1, req['stdout']), (2, req['stderr'])):
            out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(out, fd)
            os.close(out)
        os.chdir(req['cwd'])
        os.environ.clear()
        os.environ.update(req['env'])
        if 'numpy' in sys.modules:  # a fresh process seeds numpy's global generator afresh
            sys.modules['numpy'].random.seed()
        argv = req['argv']
        if argv[0] == '-m':
            sys.argv = [argv[1]] + argv[2:]  # runpy puts the module's file name in argv[0]
            sys.path[0] = os.getcwd()
            runpy.run_module(argv[1], run_name='__main__', alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path[0] = osp.dirname(osp.realpath(argv[0]))
            runpy.run_path(argv[0], run_name='__main__')
        rc = 0
    except SystemExit as e:
        rc = _exit_code(e.code)
    except BaseException:  # as the interpreter: the traceback on stderr, exit status 1
        sys.excepthook(*sys.exc_info())
        rc = 1
    try:
        threading._shutdown()  # what the interpreter does at exit: join non-daemon threads
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:  # pragma: no cover
        pass
    os._exit(rc)


def main():
    proto_in, proto_out = os.dup(0), os.dup(1)  # the requests and replies: not the children's
    replies = os.fdopen(proto_out, 'w', buffering=1, closefd=False)
    for name in PRELOAD:
        before = _threads()
        try:
            importlib.import_module(name)
        except ImportError:
            continue
        if _threads() != before and name not in BLAS_POOLS:
            replies.write(json.dumps({'unavailable': f'importing {name} started a thread'}) + '\n')
            return
    # mmengine's config lookups done once here for every child (tests/lookups.py),
    # and the objects alive now left out of the children's garbage collections
    from lookups import keep_config_and_env_lookups
    before = _threads()
    keep_config_and_env_lookups(warm=True)
    if _threads() != before:
        replies.write(json.dumps({'unavailable': 'the lookups started a thread'}) + '\n')
        return
    gc.collect()
    gc.freeze()
    replies.write(json.dumps({'ready': True}) + '\n')
    with os.fdopen(proto_in, 'r', closefd=False) as requests:
        for line in requests:
            req = json.loads(line)
            pid = os.fork()
            if pid == 0:
                _child(req, proto_in, proto_out)
            replies.write(json.dumps({'pid': pid}) + '\n')
            _, status = os.waitpid(pid, 0)
            replies.write(json.dumps({'rc': os.waitstatus_to_exitcode(status)}) + '\n')


if __name__ == '__main__':
    main()
