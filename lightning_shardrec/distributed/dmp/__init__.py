"""``DistributedModelParallel``: TorchRec's arguments resolved into settings (``dmp_settings``, ``sharders``), what
is shardable and one collection sharded (``shardable``), the plan applied to a model (``model_parallel``, ``shard``)
and its state dict with the model's own keys (``dmp_state``).
May import comm/, sharding/, sharded/, kernels, modules, optim, planner; never health/ or the Lightning layer.
"""
