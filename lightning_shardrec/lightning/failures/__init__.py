"""Failures: a failed rank named and every rank stopped (``rank_failures``), a bad id located (``data_errors``),
SIGTERM during a fit (``sigterm``, ``signals``) and a clean exit (``teardown``).
May import training/ (``control``) and the layers below; never strategies/, parameters/ or checkpoints/.
"""
