"""Checkpoints of a sharded model (``checkpointing``), Lightning's ``CheckpointIO`` plugin that reads them
(``checkpoint_io``) and the full tables on rank 0 after fit (``after_fit``).
May import parameters/, training/ and the layers below; never strategies/.
"""
