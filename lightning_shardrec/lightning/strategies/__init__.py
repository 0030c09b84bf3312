"""The two strategies, ``ShardRecStrategy`` (Trainer, ``strategy``) and ``ShardRecFabricStrategy`` (``fabric``),
built from ``ShardRecOptions`` (``options``), with the ranks per host as Lightning laid them out (``cluster``).
May import every other room of lightning/ and the layers below; only parameters/ imports it (``ShardRecOptions``).
"""
