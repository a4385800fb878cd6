"""linattn_mm.utils.use_heap_allocator: after it, a large CPU tensor is served from the heap (no
mmapped block in glibc's statistics), before it from a fresh mmap. Run in subprocesses (the
setting changes the allocator of the whole process)."""
import json
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    platform.system() != 'Linux' or platform.libc_ver()[0] != 'glibc', reason='glibc only')

SCRIPT = r'''
import ctypes, json, sys
import torch
from linattn_mm.utils import use_heap_allocator

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        'arena', 'ordblks', 'smblks', 'hblks', 'hblkhd', 'usmblks', 'fsmblks', 'uordblks',
        'fordblks', 'keepcost')]

libc = ctypes.CDLL('libc.so.6')
libc.mallinfo2.restype = MallInfo2
applied = use_heap_allocator() if sys.argv[1] == 'on' else None
before = libc.mallinfo2().hblkhd
t = torch.empty(48 * 2**20 // 4)  # 48 MiB, above the largest mmap threshold (32 MiB)
t.fill_(1)
during = libc.mallinfo2().hblkhd
arena = libc.mallinfo2().arena
json.dump(dict(applied=applied, mmapped=during - before, arena=arena), sys.stdout)
'''


def run(mode):
    out = subprocess.run([sys.executable, '-c', SCRIPT, mode], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def test_large_tensors_come_from_the_heap_after_the_call():
    if not hasattr(__import__('ctypes').CDLL('libc.so.6'), 'mallinfo2'):
        pytest.skip('glibc without mallinfo2 (< 2.33)')
    off, on = run('off'), run('on')
    assert off['applied'] is None and off['mmapped'] >= 48 * 2**20  # the default: a fresh mmap
    assert on['applied'] is True and on['mmapped'] == 0  # now from the heap
    assert on['arena'] >= 48 * 2**20


def test_bad_argument_is_named():
    from linattn_mm.utils import use_heap_allocator
    with pytest.raises(ValueError, match='top_pad_mb must be >= 0'):
        use_heap_allocator(top_pad_mb=-1)
