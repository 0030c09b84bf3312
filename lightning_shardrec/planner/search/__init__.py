"""The search for a plan: per-table options (``enumerate``), filling ranks (``fill``, ``grid``), the ``partition``,
``EmbeddingShardingPlanner`` (``planner``) and the one plan agreed across ranks (``collective``).
May import plans/, machine/, costs/ and configs, errors, modules; nothing of planner/ imports it but the package.
"""
