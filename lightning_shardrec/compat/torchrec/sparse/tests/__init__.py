"""What TorchRec's own sparse tests import from ``torchrec.sparse.tests`` (:mod:`.utils`)."""
