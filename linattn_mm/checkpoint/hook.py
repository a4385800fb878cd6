"""An mmengine runner hook that applies the checkpoint allow-list while the runner loads.

mmengine 0.10.7 reads ``load_from`` / ``--resume`` files with a plain ``torch.load`` (weights-only
since torch 2.6), and its runner checkpoints pickle ``HistoryBuffer`` objects and numpy values in
``message_hub``. The stock OpenMMLab tools (``mim train`` / ``mim test``) give linattn_mm no other
place to act than the config, so the configs of this repository add::

    custom_hooks = [dict(type='linattn_mm.SafeGlobalsHook')]

``Runner.train()``, ``val()`` and ``test()`` call the hooks' ``before_run`` and then
``load_or_resume()``; the loop's ``before_train`` / ``before_val`` / ``before_test`` follows. The
hook enters :func:`~linattn_mm.checkpoint.safe_globals` in ``before_run`` and leaves it when the
loop starts (or in ``after_run``), so the allow-list covers the weight initialisation and the
checkpoint loading of the run, not the training itself.
"""
import contextlib

from mmengine.hooks import Hook

from linattn_mm.registry import register_hook

from .allowlist import safe_globals

__all__ = ['SafeGlobalsHook']


@register_hook
class SafeGlobalsHook(Hook):
    """Allow-list :data:`~linattn_mm.checkpoint.SAFE_GLOBALS` for ``torch.load`` from
    ``before_run`` until the train / val / test loop starts (then torch's allow-list is as before).
    Add it with ``custom_hooks = [dict(type='linattn_mm.SafeGlobalsHook')]``."""
    priority = 'VERY_HIGH'

    def __init__(self):
        self._scope = None

    def before_run(self, runner) -> None:
        self._leave()
        self._scope = contextlib.ExitStack()
        self._scope.enter_context(safe_globals())

    def _leave(self, runner=None) -> None:
        if self._scope is not None:
            scope, self._scope = self._scope, None
            scope.close()

    before_train = before_val = before_test = after_run = _leave

