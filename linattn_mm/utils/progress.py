"""Progress bars for the long offline tools: drawn on stderr, only when stderr is a terminal, so
the lines the tools print on stdout (which scripts and tests parse) never change."""
import sys

__all__ = ['progress_bar', 'emit']


def progress_bar(total, desc, unit='it', **kwargs):
    """A tqdm bar over ``total`` steps on stderr when stderr is a terminal, else None."""
    if not sys.stderr.isatty():
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=False, **kwargs)


def emit(bar, line):
    """``print(line)`` to stdout; with a bar, written above it so the bar stays intact."""
    if bar is None:
        print(line, flush=True)
    else:
        bar.write(line, file=sys.stdout)
        sys.stdout.flush()
