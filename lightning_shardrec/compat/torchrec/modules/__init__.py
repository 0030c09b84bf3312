"""TorchRec's ``torchrec.modules.*`` modules that only mirror its layout; served at
``lightning_shardrec.modules.<path>`` by :mod:`lightning_shardrec.compat.torchrec.paths`.
The collections themselves are :mod:`lightning_shardrec.modules`.
"""
