"""Failures: a failed rank named and every rank stopped (``rank_failures``), a bad id located (``data_errors``),
SIGTERM during a fit (``sigterm``, ``signals``) and a clean exit (``teardown``).
May import the layers below the Lightning layer only; no other room of lightning/ (training/'s ``control`` imports it).
"""
