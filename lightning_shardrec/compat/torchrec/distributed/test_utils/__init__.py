"""What TorchRec users' own tests import from ``torchrec.distributed.test_utils``: a ``TestSparseNN``-style
model with its ``ModelInput`` (:mod:`.test_model`) and ``MultiProcessTestBase`` (:mod:`.multi_process`)."""
