"""Progress bars for the long offline tools: drawn on stderr, only when stderr is a terminal, so
the lines the tools print on stdout (which scripts and tests parse) never change; and quieting
mmengine's per-parameter initialisation log where a tool or API builds a model only to fill it."""
import contextlib
import logging
import sys

__all__ = ['progress_bar', 'emit', 'quiet_init_log']


@contextlib.contextmanager
def quiet_init_log():
    """mmengine's current logger at WARNING inside: ``init_weights`` logs every parameter's
    initialisation at INFO (hundreds of lines for a detector) before any checkpoint is loaded."""
    from mmengine.logging import MMLogger
    logger = MMLogger.get_current_instance()
    level = logger.level
    logger.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        logger.setLevel(level)


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
