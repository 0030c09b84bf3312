"""The training step as Lightning runs it: the pipelined input distribution (``pipeline``, ``handover``), uneven data
(``uneven``, on the ``control`` group), deferred updates (``deferred``), precision plugins and clipping ``guards``.
May import failures/ (``teardown``) and the layers below; never strategies/, parameters/ or checkpoints/.
"""
