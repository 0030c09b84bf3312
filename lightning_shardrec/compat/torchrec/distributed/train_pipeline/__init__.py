"""Training pipelines at TorchRec's path (``torchrec.distributed.train_pipeline``)."""

from lightning_shardrec.distributed.pipelines.sparse_dist import EvalPipelineSparseDist, TrainPipelineSparseDist
from lightning_shardrec.errors import missing_names

_ONE = "TrainPipelineSparseDist is the pipeline here (or Trainer(strategy=ShardRecStrategy(pipeline=True)))"
__getattr__ = missing_names(
    __name__,
    {
        n: _ONE
        for n in (
            "TrainPipeline",
            "TrainPipelineBase",
            "PrefetchTrainPipelineSparseDist",
            "StagedTrainPipeline",
            "TrainPipelineSemiSync",
            "DataLoadingThread",
        )
    },
)

__all__ = ["EvalPipelineSparseDist", "TrainPipelineSparseDist"]
