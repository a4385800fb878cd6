"""Packaging for linattn_mm: linear-attention backbones for OpenMMLab.

The configs under ``configs/`` are shipped inside the package as ``linattn_mm/.mim/configs`` so that
``linattn_mm.get_model`` and ``mim`` find them after a non-editable install.
"""
import os
import shutil

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))


def module_scope(name):
    """The names a module of the package defines, read without importing the package (which
    needs torch): ``version`` and ``tools`` import nothing of it."""
    scope = {}
    with open(os.path.join(HERE, 'linattn_mm', f'{name}.py')) as f:
        exec(f.read(), scope)
    return scope


def read_version():
    return module_scope('version')['__version__']


def shipped_tools():
    """What a built package carries under linattn_mm/.mim/tools: the tools and launchers that
    ``linattn_mm.tools`` runs (tests/e2e/test_packaging.py compares them with the wheel)."""
    tools = module_scope('tools')
    return [f'{name}.py' for name in tools['TOOLS']] + list(tools['LAUNCHERS'])


class BuildWithMimFiles(build_py):
    """Copy ``configs/`` into the built package as ``linattn_mm/.mim/configs``, and the user
    tools of ``tools/`` as ``linattn_mm/.mim/tools`` (from the source tree, or from an sdist,
    which carries them through MANIFEST.in): OpenMMLab's layout, which ``python -m
    linattn_mm.tools`` and ``mim`` run them from."""

    def run(self):
        super().run()
        mim = os.path.join(self.build_lib, 'linattn_mm', '.mim')
        src = os.path.join(HERE, 'configs')
        dst = os.path.join(mim, 'configs')
        if os.path.isdir(src):
            shutil.rmtree(dst, ignore_errors=True)
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns('__pycache__', '*.py[cod]'))
        dst = os.path.join(mim, 'tools')
        if os.path.isdir(os.path.join(HERE, 'tools')):
            shutil.rmtree(dst, ignore_errors=True)
            os.makedirs(dst)
            for name in shipped_tools():
                shutil.copy2(os.path.join(HERE, 'tools', name), os.path.join(dst, name))


setup(
    name='linattn_mm',
    version=read_version(),
    description='Linear-complexity attention backbones (PolaFormer, NaLaFormer, Poly-NL/SA, PADRe, '
    'SeTformer) for mmdetection, mmsegmentation and mmpretrain',
    long_description=open(os.path.join(HERE, 'README.md')).read() if os.path.exists(
        os.path.join(HERE, 'README.md')) else '',
    long_description_content_type='text/markdown',
    packages=find_packages(include=['linattn_mm', 'linattn_mm.*']),
    python_requires='>=3.10',  # torch 2.13.0's own requirement
    install_requires=[
        # '==': a CUDA build with a local label (2.13.0+cu126) satisfies it. The project's own
        # environment pins '===' through tools/constraints.txt (tools/bootstrap.sh).
        'torch==2.13.0',
        'torchvision==0.28.0',
        'mmengine==0.10.7',
        'mmcv==2.1.0',
        'mmdet==3.3.0',
        'mmsegmentation==1.2.2',
        'mmpretrain==1.2.0',
        'ftfy',
        'regex',
        'setuptools<81',
    ],
    extras_require={'tests': ['pytest']},
    cmdclass={'build_py': BuildWithMimFiles},
    entry_points={'console_scripts': ['linattn-mm = linattn_mm.tools:main']},
    license='Apache-2.0',
    zip_safe=False,
)
