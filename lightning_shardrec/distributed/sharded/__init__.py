"""The sharded collections: ``ShardedEmbeddingBagCollection`` (pooled), ``ShardedEmbeddingCollection`` (sequence),
what both share (tables, shards, prefetch, a batch's input distribution), and the plain modules' sharded forms.
May import comm/, sharding/, kernels, modules, optim, planner, sparse; dmp/ only for the sharders' TorchRec names.
"""
