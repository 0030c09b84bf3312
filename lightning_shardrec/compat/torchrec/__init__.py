"""TorchRec's module paths, in one place: the mirrors of TorchRec's layout (``datasets``, ``distributed.planner``,
``distributed.types``, ...) and the finder (``paths``) that serves ``lightning_shardrec.<torchrec path>`` from them.
May import every core package; no core package imports it (the finder resolves the paths by name, lazily).
"""
