"""TorchRec's ``torchrec.sparse.*`` paths that only mirror its layout (its test helpers); served at
``lightning_shardrec.sparse.<path>`` by :mod:`lightning_shardrec.compat.torchrec.paths`. The sparse types
themselves are :mod:`lightning_shardrec.sparse`.
"""
