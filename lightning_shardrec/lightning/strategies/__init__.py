"""The two strategies, ``ShardRecStrategy`` (Trainer, ``strategy``) and ``ShardRecFabricStrategy`` (``fabric``),
built from ``ShardRecOptions`` (``options``), with the ranks per host as Lightning laid them out (``cluster``).
May import every other room of lightning/ and everything below the Lightning layer; nothing imports it but the package.
"""
