"""Hand-written training loops around a sharded model: ``TrainPipelineSparseDist`` runs batch ``i + 1``'s input
distribution while batch ``i`` trains (``sparse_dist``); the Lightning strategy's own pipeline is lightning/pipeline.py.
May import comm/, sharded/, sparse, errors; never dmp/ or health/.
"""
