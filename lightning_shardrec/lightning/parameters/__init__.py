"""The model's parameters under a strategy: ``ShardedTables`` (planner step, sharding, fused optimizer), the
``DenseReplicas``, ``StepUpdates``, the user's optimizers seen from the tables (``optimizers``, ``fused_params``, ...).
May import training/, failures/, reports/ strategies/ (``options``), the layers below; not checkpoints/
"""
