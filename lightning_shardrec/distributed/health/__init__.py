"""Which rank died: heartbeats in the process group's store (``heartbeats``) and where each rank's process runs
(``whereabouts``), so a failure names the rank and its host instead of hanging in a collective.
May import comm/ and _compat; nothing else of distributed/.
"""
