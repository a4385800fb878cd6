"""Lookups that mmengine repeats for every config and every runner, kept for the life of a test
process (a pytest worker, or a fork server and the tools it forks). Their answers cannot change
while the installed packages do not, and the tests install none into the environment they run in.

- A config's ``mmdet::`` / ``mmseg::`` / ``mmpretrain::`` base: mmengine looks the name up among
  the package's released models first, parsing every metafile its ``model-index.yml`` lists
  (0.26 to 0.36 s per package on a 2-core machine), and checks the package is installed by
  reloading ``pkg_resources`` (80 ms). The metafiles are now parsed once per process and the
  installed packages remembered.
- A runner's environment report (``collect_env``: compilers, CUDA, the libraries' build
  information; about 0.3 s, with ``gcc`` run in a subprocess) is made once per process (in a
  pytest worker; each tool a fork server forks makes its own).

Configs, runners and their logs are the same as without these: only the repetition goes."""
import functools


def keep_config_and_env_lookups(warm=False):
    """Keep the lookups above in this process. ``warm``: do the metafiles' now (a fork server, so
    that every tool it forks finds them done). The environment report is not made ahead: it asks
    torch for the GPUs, and a process that has initialised CUDA cannot fork a child that uses it."""
    from mmengine.config import config as mm_config
    from mmengine.config import utils as cfg_utils
    from mmengine.runner import runner as mm_runner
    if getattr(cfg_utils.load, 'kept', False):
        return
    load = cfg_utils.load

    @functools.lru_cache(maxsize=None)
    def metafile(path):
        return load(path)

    def kept_load(file, *args, **kwargs):
        # _get_cfg_metainfo only reads the model index and metafiles it loads
        if isinstance(file, str) and not args and not kwargs and file.endswith('.yml'):
            return metafile(file)
        return load(file, *args, **kwargs)

    kept_load.kept = True
    cfg_utils.load = kept_load

    is_installed, installed = mm_config.is_installed, set()

    def kept_is_installed(package):
        if package not in installed and is_installed(package):
            installed.add(package)  # only a yes is kept: a missing package still fails each time
        return package in installed

    mm_config.is_installed = kept_is_installed
    mm_runner.collect_env = functools.lru_cache(maxsize=None)(mm_runner.collect_env)
    if warm:
        from mmengine.utils import get_installed_path
        for package in ('mmdet', 'mmseg', 'mmpretrain'):
            if kept_is_installed(package):
                try:  # a name no metafile has: every metafile parsed, then the error
                    cfg_utils._get_cfg_metainfo(get_installed_path(package), '')
                except ValueError:
                    pass
