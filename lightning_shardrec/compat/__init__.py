"""Other libraries' module layouts mapped onto this one: ``compat.torchrec`` serves TorchRec's paths.

(Private torch and Lightning symbols live in ``lightning_shardrec._compat``, a different thing.)
Nothing in the core packages imports ``compat``; ``compat`` imports the core.
"""
