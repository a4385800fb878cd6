"""Packaging for linattn_mm: linear-attention backbones for OpenMMLab.

The configs under ``configs/`` are shipped inside the package as ``linattn_mm/.mim/configs`` so that
``linattn_mm.get_model`` and ``mim`` find them after a non-editable install.
"""
import os
import shutil

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))


def read_version():
    scope = {}
    with open(os.path.join(HERE, 'linattn_mm', 'version.py')) as f:
        exec(f.read(), scope)
    return scope['__version__']


class BuildWithConfigs(build_py):
    """Copy ``configs/`` into the built package as ``linattn_mm/.mim/configs`` (from the
    source tree, or from an sdist, which carries them through MANIFEST.in)."""

    def run(self):
        super().run()
        src = os.path.join(HERE, 'configs')
        dst = os.path.join(self.build_lib, 'linattn_mm', '.mim', 'configs')
        if os.path.isdir(src):
            shutil.rmtree(dst, ignore_errors=True)
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns('__pycache__', '*.py[cod]'))


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
    cmdclass={'build_py': BuildWithConfigs},
    license='Apache-2.0',
    zip_safe=False,
)
