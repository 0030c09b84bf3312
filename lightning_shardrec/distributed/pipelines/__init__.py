"""Hand-written training loops around a sharded model: ``TrainPipelineSparseDist`` runs batch ``i + 1``'s input
distribution while batch ``i`` trains (``sparse_dist``); the strategy's own is lightning/training/pipeline.py.
May import comm/, sharded/, sparse, errors; never dmp/ or health/.
"""
