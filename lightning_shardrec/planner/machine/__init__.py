"""The (possibly pretend) cluster planned for: ranks, hosts and bandwidths (``topology``), the host ``mesh``,
the memory a rank may fill (``memory``) and measured ``rates``.
May import plans/ (``types``) and configs, errors; never costs/ or search/.
"""
