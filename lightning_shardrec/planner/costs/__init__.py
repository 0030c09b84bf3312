"""The cost model: seconds per step a shard costs its rank (``perf``), its bytes (``storage``) and what a plan shows
about its dynamic tables (``dynamic_plan``).
May import plans/ and machine/; never search/.
"""
