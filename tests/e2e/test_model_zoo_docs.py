"""The model-zoo pages (docs/model_zoo/*.md) list every config, and every config they list exists.

A page refers to a config by its repository path, in one of two forms:

* a Markdown link whose target resolves (relative to the page) into ``configs/``, e.g.
  ``[pola-pvt-t_in1k](../../configs/polaformer/pola-pvt-t_in1k.py)``;
* a path in backticks that starts with ``configs/`` and ends with ``.py``, e.g.
  ``configs/polaformer/pola-swin-t_in1k.py``. Shell-style braces are expanded:
  ``configs/setformer/setformer-{m,t,s}_in1k.py`` names three files.

Bare file names and stems (``retinanet_padre-swin-t_fpn_1x_coco.py``) are prose, not references.
Files in ``_base_`` folders may be referenced but need not be.
"""
import glob
import itertools
import os
import os.path as osp
import re

from harness import REPO, all_configs

ZOO = osp.join(REPO, 'docs', 'model_zoo')
LINK = re.compile(r'\]\(([^)\s]+\.py)\)')
CODE = re.compile(r'`([^`\n]+)`')
# a path, in which a brace group may hold commas: configs/x/y-{t,s}_in1k.py
CONFIG_PATH = re.compile(r'configs/(?:\{[^{}`\s]*\}|[^\s`\'",;(){}])+?\.py\b')
BRACES = re.compile(r'\{([^{}]*)\}')


def expand_braces(text):
    """``a{b,c}d{e,f}`` -> ``[abde, abdf, acde, acdf]`` (comma lists only)."""
    parts = BRACES.split(text)
    literals, choices = parts[0::2], [p.split(',') for p in parts[1::2]]
    out = []
    for combo in itertools.product(*choices):
        s = literals[0]
        for choice, lit in zip(combo, literals[1:]):
            s += choice + lit
        out.append(s)
    return out


def references(page):
    """Repository-relative config paths referred to by ``page`` (``configs/...py``)."""
    with open(page, encoding='utf-8') as f:
        text = f.read()
    refs = set()
    for target in LINK.findall(text):
        path = osp.relpath(osp.normpath(osp.join(osp.dirname(page), target)), REPO)
        path = path.replace(os.sep, '/')
        if path.startswith('configs/'):
            refs.add(path)
    for span in CODE.findall(text):
        for m in CONFIG_PATH.finditer(span):
            refs.update(expand_braces(m.group(0)))
    return refs


def test_expand_braces():
    assert expand_braces('configs/a/x-{t,s}_in1k{,_demo}.py') == [
        'configs/a/x-t_in1k.py', 'configs/a/x-t_in1k_demo.py', 'configs/a/x-s_in1k.py',
        'configs/a/x-s_in1k_demo.py']
    assert expand_braces('configs/a/b.py') == ['configs/a/b.py']


def test_model_zoo_pages_list_every_config():
    pages = sorted(glob.glob(osp.join(ZOO, '*.md')))
    assert pages, f'no model-zoo pages in {ZOO}'
    listed, where = set(), {}
    for page in pages:
        for ref in references(page):
            listed.add(ref)
            where.setdefault(ref, osp.basename(page))
    missing_files = sorted(f'{p} (in {where[p]})' for p in listed
                           if not osp.isfile(osp.join(REPO, p)))
    listed = {p for p in listed if '_base_' not in p.split('/')}
    configs = all_configs()
    unlisted = sorted(configs - listed)
    assert not missing_files and not unlisted, (
        f'{len(unlisted)} configs are on no docs/model_zoo page: {unlisted}; '
        f'{len(missing_files)} listed paths do not exist: {missing_files}')
