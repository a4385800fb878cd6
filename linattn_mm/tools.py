"""The command-line tools of linattn_mm, from wherever the package is installed::

    python -m linattn_mm.tools                  # the list of tools
    python -m linattn_mm.tools train CONFIG [--demo] [--amp] [--attn-core fused] ...
    linattn-mm test CONFIG CHECKPOINT           # the same, as the package's console script
    torchrun --nproc_per_node 8 -m linattn_mm.tools train CONFIG --launcher pytorch

Each tool runs as ``python tools/NAME.py ARGS`` does in a source checkout, with the same
arguments. A wheel (or an install from the sdist) carries them as ``linattn_mm/.mim/tools``, the
layout of OpenMMLab packages (``mim train linattn_mm CONFIG`` looks for ``.mim/tools/train.py``),
with the launchers ``dist_train.sh`` and ``dist_test.sh``; an editable install or a source
checkout runs the repository's ``tools/``. The repository's maintenance tools (the fidelity
report, the learning check, the test and set-up scripts) write into the checkout and are not
shipped.
"""
import os.path as osp
import runpy
import sys

__all__ = ['TOOLS', 'LAUNCHERS', 'tools_dir', 'tool_path', 'main']

#: the tools a user runs, by name (``tools/<name>.py``), with what each does
TOOLS = {
    'train': 'train a detector, segmentor or classifier from a config',
    'test': 'test a checkpoint of a config (AP, mIoU, accuracy)',
    'benchmark': 'time and peak memory of backbones, models and attention cores',
    'get_flops': 'parameters and multiply-accumulates of a model, every attention matmul counted',
    'convert_checkpoint': 'an official / mmpretrain / raw checkpoint to a tensors-only file',
    'make_demo_data': 'the deterministic demo data (COCO, ADE20K and ImageNet formats)',
    'browse_dataset': 'draw the ground truth of a config\'s samples after its pipeline',
    'visualize_attention': 'attention maps of a query token and the entropy of every layer',
}

#: the shell launchers shipped with them (multi-process training and testing with torchrun)
LAUNCHERS = ('dist_train.sh', 'dist_test.sh', 'dist_python.sh')


def tools_dir():
    """The folder the tools run from: the installed package's ``.mim/tools``, or the ``tools``
    folder of the source checkout the package was imported from; None without either."""
    package = osp.dirname(osp.abspath(__file__))
    for folder in (osp.join(package, '.mim', 'tools'), osp.join(osp.dirname(package), 'tools')):
        if osp.isfile(osp.join(folder, 'train.py')):
            return folder
    return None


def tool_path(name):
    """The file of the tool ``name`` (``'train'`` or ``'train.py'``). Raises ``ValueError`` for
    a name that is not a tool and ``FileNotFoundError`` when this installation has no tools."""
    name = name[:-3] if name.endswith('.py') else name
    if name not in TOOLS:
        raise ValueError(f'linattn_mm.tools: no tool named {name!r}; the tools are '
                         f'{", ".join(TOOLS)}')
    folder = tools_dir()
    if folder is None or not osp.isfile(osp.join(folder, f'{name}.py')):
        raise FileNotFoundError(
            f'linattn_mm.tools: {name}.py is not in this installation of linattn_mm '
            f'({osp.dirname(osp.abspath(__file__))}): neither its .mim/tools (made when a wheel '
            'is built) nor a source checkout\'s tools/; reinstall it from a wheel or the sdist')
    return osp.join(folder, f'{name}.py')


def _usage():
    width = max(map(len, TOOLS))
    rows = '\n'.join(f'  {name.ljust(width)}  {what}' for name, what in TOOLS.items())
    return ('usage: python -m linattn_mm.tools TOOL [ARGS ...]   (or: linattn-mm TOOL ...)\n\n'
            f'tools (TOOL --help for their arguments):\n{rows}\n\n'
            f'from: {tools_dir() or "(none found in this installation)"}')


def main(argv=None):
    """Run the tool named by the first argument with the rest, as ``python tools/NAME.py``
    would (``sys.argv[0]`` is the tool's file)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ('-h', '--help'):
        print(_usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    try:
        path = tool_path(argv[0])
    except (ValueError, FileNotFoundError) as err:
        print(f'{err}\n\n{_usage()}', file=sys.stderr)
        return 2
    sys.argv = [path] + argv[1:]
    runpy.run_path(path, run_name='__main__')
    return 0


if __name__ == '__main__':
    sys.exit(main())
