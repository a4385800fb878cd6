"""The load report: what a :func:`~linattn_mm.checkpoint.load_pretrained` or
:func:`~linattn_mm.checkpoint.convert_checkpoint` call loaded, resized, dropped or could not
match."""
import collections
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Tuple

__all__ = ['LoadReport', 'format_keys']


def format_keys(keys: Iterable[str], limit: int = 10) -> str:
    """``'a', 'b', ... (+n more)``: the first ``limit`` keys, quoted, for messages."""
    keys = list(keys)
    shown = ', '.join(repr(k) for k in keys[:limit])
    return shown + (f', ... (+{len(keys) - limit} more)' if len(keys) > limit else '')


@dataclass
class LoadReport:
    """What a :func:`load_pretrained` / :func:`convert_checkpoint` call did.

    Attributes:
        source: key path the state dict came from (``'model_ema'``, ``'state_dict'``, ``'raw'``...).
        loaded: keys copied into the model (or written, for conversion).
        missing: model keys the checkpoint did not provide.
        unexpected: checkpoint keys the model does not have (not loaded).
        resized: key -> (checkpoint shape, model shape) for tensors adapted by the
            owning module's ``resize_checkpoint_tensor``.
        dropped: key -> reason for checkpoint keys removed on purpose (heads, buffers, prefixes...).
        non_tensor: non-tensor entries removed from the state dict.
        notes: key -> remark from that method (e.g. a dropped class-token row).
        checkpoint: name of the checkpoint (path/URL or ``'<in-memory dict>'``).
    """
    source: str = ''
    loaded: List[str] = field(default_factory=list)
    missing: List[str] = field(default_factory=list)
    unexpected: List[str] = field(default_factory=list)
    resized: Dict[str, Tuple[Tuple[int, ...], Tuple[int, ...]]] = field(default_factory=dict)
    dropped: Dict[str, str] = field(default_factory=dict)
    non_tensor: List[str] = field(default_factory=list)
    notes: Dict[str, str] = field(default_factory=dict)
    checkpoint: str = ''

    @property
    def ok(self) -> bool:
        """True when nothing is missing or unexpected."""
        return not self.missing and not self.unexpected

    def summary(self, limit: int = 20) -> str:
        """Multi-line human-readable summary; each key list is truncated to ``limit`` entries."""
        lines = [f"Pretrained checkpoint '{self.checkpoint}' (state dict from '{self.source}'): "
                 f'{len(self.loaded)} loaded, {len(self.resized)} resized, {len(self.missing)} '
                 f'missing, {len(self.unexpected)} unexpected, {len(self.dropped)} dropped, '
                 f'{len(self.non_tensor)} non-tensor removed']

        def section(title, items):
            items = list(items)
            if not items:
                return
            lines.append(f'  {title} ({len(items)}):')
            for item in items[:limit]:
                lines.append(f'    {item}')
            if len(items) > limit:
                lines.append(f'    ... (+{len(items) - limit} more)')

        section('missing in checkpoint (left at initialisation)', self.missing)
        section('unexpected in checkpoint (not loaded)', self.unexpected)
        section('resized', [
            f'{k}: {tuple(old)} -> {tuple(new)}' + (f' [{self.notes[k]}]' if self.notes.get(k)
                                                    else '')
            for k, (old, new) in self.resized.items()])
        other_notes = {k: v for k, v in self.notes.items() if k not in self.resized}
        section('notes', [f'{k}: {v}' for k, v in other_notes.items()])
        by_reason: Dict[str, List[str]] = collections.OrderedDict()
        for k, reason in self.dropped.items():
            by_reason.setdefault(reason, []).append(k)
        section('dropped', [f'{reason}: {len(ks)} key(s): {format_keys(ks, 6)}'
                            for reason, ks in by_reason.items()])
        section('non-tensor entries removed', self.non_tensor)
        return '\n'.join(lines)
