# Every detection / segmentation config inherits this through its family's _base_/backbones.py,
# every ImageNet config next to its stock mmpretrain base (a config that sets custom_hooks itself
# lists the hook there).
# mmengine's runner checkpoints pickle HistoryBuffer objects and numpy values, which
# torch.load(weights_only=True) refuses unless allow-listed; the hook allow-lists those harmless
# objects while the runner initialises and loads (`load_from`, `--resume`), and only then, so the
# stock tools (`mim train` / `mim test`) can resume and test the runs' own checkpoints.
custom_hooks = [dict(type='linattn_mm.SafeGlobalsHook')]
