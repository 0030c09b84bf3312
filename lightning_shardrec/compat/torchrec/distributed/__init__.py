"""TorchRec's ``torchrec.distributed.*`` modules that only mirror its layout; served at
``lightning_shardrec.distributed.<path>`` by :mod:`lightning_shardrec.compat.torchrec.paths`.
The design they map onto is :mod:`lightning_shardrec.distributed`.
"""
