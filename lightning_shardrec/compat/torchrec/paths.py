"""TorchRec's public module paths: ``lightning_shardrec.<path>`` never fails with a bare ``ModuleNotFoundError``.

Importing ``lightning_shardrec`` installs :class:`TorchRecPathFinder` first on ``sys.meta_path``:
a TorchRec path whose module lives elsewhere here (``ALIASES``: the mirrors in ``compat/torchrec/``, or a
module of the core in its room) imports as that same module object; any other module path this library
provides imports as usual; a TorchRec path it does not provide raises
:class:`~lightning_shardrec.errors.MissingTorchRecFeatureError` (an ``ImportError``) naming the path
and the ``docs/migrating.md`` section. The list is TorchRec's non-test, non-private modules.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Sequence
from importlib.abc import Loader
from importlib.machinery import ModuleSpec, PathFinder
from types import ModuleType

from lightning_shardrec.errors import MissingTorchRecFeatureError

#: TorchRec's public module paths, relative to the package (``torchrec.distributed.types`` -> ``distributed.types``)
TORCHREC_MODULES: frozenset[str] = frozenset(
    (
        "datasets",
        "datasets.criteo",
        "datasets.movielens",
        "datasets.random",
        "datasets.scripts",
        "datasets.scripts.contiguous_preproc_criteo",
        "datasets.scripts.npy_preproc_criteo",
        "datasets.scripts.nvt.convert_parquet_to_binary",
        "datasets.scripts.nvt.convert_tsv_to_parquet",
        "datasets.scripts.nvt.process_criteo_parquet",
        "datasets.scripts.nvt.split_binary_dataset",
        "datasets.scripts.nvt.utils",
        "datasets.scripts.nvt.utils.criteo_constant",
        "datasets.scripts.nvt.utils.dask",
        "datasets.scripts.shuffle_preproc_criteo",
        "datasets.utils",
        "distributed",
        "distributed.batched_embedding_kernel",
        "distributed.collective_utils",
        "distributed.comm",
        "distributed.comm_ops",
        "distributed.composable",
        "distributed.composable.table_batched_embedding_slice",
        "distributed.dist_data",
        "distributed.embedding",
        "distributed.embedding_dim_bucketer",
        "distributed.embedding_kernel",
        "distributed.embedding_lookup",
        "distributed.embedding_sharding",
        "distributed.embedding_tower_sharding",
        "distributed.embedding_types",
        "distributed.embeddingbag",
        "distributed.fbgemm_qcomm_codec",
        "distributed.fp_embeddingbag",
        "distributed.fused_embedding",
        "distributed.fused_embeddingbag",
        "distributed.fused_params",
        "distributed.global_settings",
        "distributed.grouped_position_weighted",
        "distributed.infer_utils",
        "distributed.itep_embeddingbag",
        "distributed.keyed_jagged_tensor_pool",
        "distributed.logger",
        "distributed.logging_handlers",
        "distributed.mc_embedding",
        "distributed.mc_embedding_modules",
        "distributed.mc_embeddingbag",
        "distributed.mc_modules",
        "distributed.model_parallel",
        "distributed.model_tracker",
        "distributed.model_tracker.delta_store",
        "distributed.model_tracker.model_delta_tracker",
        "distributed.model_tracker.types",
        "distributed.object_pool",
        "distributed.planner",
        "distributed.planner.constants",
        "distributed.planner.enumerators",
        "distributed.planner.partitioners",
        "distributed.planner.perf_models",
        "distributed.planner.planners",
        "distributed.planner.proposers",
        "distributed.planner.shard_estimators",
        "distributed.planner.stats",
        "distributed.planner.storage_reservations",
        "distributed.planner.types",
        "distributed.planner.utils",
        "distributed.quant_embedding",
        "distributed.quant_embedding_kernel",
        "distributed.quant_embeddingbag",
        "distributed.quant_state",
        "distributed.shard",
        "distributed.sharding",
        "distributed.sharding.cw_sequence_sharding",
        "distributed.sharding.cw_sharding",
        "distributed.sharding.dp_sequence_sharding",
        "distributed.sharding.dp_sharding",
        "distributed.sharding.dynamic_sharding",
        "distributed.sharding.grid_sharding",
        "distributed.sharding.rw_kjt_pool_sharding",
        "distributed.sharding.rw_pool_sharding",
        "distributed.sharding.rw_sequence_sharding",
        "distributed.sharding.rw_sharding",
        "distributed.sharding.rw_tensor_pool_sharding",
        "distributed.sharding.sequence_sharding",
        "distributed.sharding.tw_sequence_sharding",
        "distributed.sharding.tw_sharding",
        "distributed.sharding.twcw_sharding",
        "distributed.sharding.twrw_sharding",
        "distributed.sharding_plan",
        "distributed.shards_wrapper",
        "distributed.tensor_pool",
        "distributed.tensor_sharding",
        "distributed.torchrec_logger",
        "distributed.torchrec_logging_handlers",
        "distributed.train_pipeline",
        "distributed.train_pipeline.pipeline_context",
        "distributed.train_pipeline.pipeline_stage",
        "distributed.train_pipeline.postproc",
        "distributed.train_pipeline.runtime_forwards",
        "distributed.train_pipeline.tracing",
        "distributed.train_pipeline.train_pipelines",
        "distributed.train_pipeline.types",
        "distributed.train_pipeline.utils",
        "distributed.types",
        "distributed.utils",
        "fx",
        "fx.tracer",
        "fx.utils",
        "inference",
        "inference.client",
        "inference.dlrm_packager",
        "inference.dlrm_predict",
        "inference.inference_legacy",
        "inference.inference_legacy.client",
        "inference.inference_legacy.model_packager",
        "inference.inference_legacy.state_dict_transform",
        "inference.model_packager",
        "inference.modules",
        "inference.state_dict_transform",
        "ir.schema",
        "ir.serializer",
        "ir.types",
        "ir.utils",
        "linter.module_linter",
        "metrics",
        "metrics.accuracy",
        "metrics.auc",
        "metrics.auprc",
        "metrics.cali_free_ne",
        "metrics.calibration",
        "metrics.calibration_with_recalibration",
        "metrics.ctr",
        "metrics.gauc",
        "metrics.hindsight_target_pr",
        "metrics.mae",
        "metrics.metric_job_types",
        "metrics.metric_module",
        "metrics.metric_state_snapshot",
        "metrics.metrics_config",
        "metrics.metrics_namespace",
        "metrics.model_utils",
        "metrics.mse",
        "metrics.multiclass_recall",
        "metrics.ndcg",
        "metrics.ne",
        "metrics.ne_positive",
        "metrics.ne_with_recalibration",
        "metrics.output",
        "metrics.precision",
        "metrics.precision_session",
        "metrics.rauc",
        "metrics.rec_metric",
        "metrics.recall",
        "metrics.recall_session",
        "metrics.scalar",
        "metrics.segmented_ne",
        "metrics.serving_calibration",
        "metrics.serving_ne",
        "metrics.tensor_weighted_avg",
        "metrics.throughput",
        "metrics.tower_qps",
        "metrics.unweighted_ne",
        "metrics.weighted_avg",
        "metrics.xauc",
        "models",
        "models.deepfm",
        "models.dlrm",
        "models.experimental",
        "models.experimental.transformerdlrm",
        "modules",
        "modules.activation",
        "modules.crossnet",
        "modules.deepfm",
        "modules.embedding_configs",
        "modules.embedding_modules",
        "modules.embedding_tower",
        "modules.feature_processor",
        "modules.feature_processor_",
        "modules.fp_embedding_modules",
        "modules.fused_embedding_modules",
        "modules.hash_mc_evictions",
        "modules.hash_mc_metrics",
        "modules.hash_mc_modules",
        "modules.itep_embedding_modules",
        "modules.itep_modules",
        "modules.keyed_jagged_tensor_pool",
        "modules.lazy_extension",
        "modules.mc_adapter",
        "modules.mc_embedding_modules",
        "modules.mc_modules",
        "modules.mlp",
        "modules.object_pool",
        "modules.object_pool_lookups",
        "modules.pruning_logger",
        "modules.regroup",
        "modules.tensor_pool",
        "modules.utils",
        "optim",
        "optim.apply_optimizer_in_backward",
        "optim.clipping",
        "optim.fused",
        "optim.keyed",
        "optim.optimizers",
        "optim.rowwise_adagrad",
        "optim.semi_sync",
        "optim.warmup",
        "pt2",
        "pt2.checks",
        "pt2.utils",
        "quant",
        "quant.embedding_modules",
        "quant.utils",
        "schema",
        "schema.utils",
        "sparse",
        "sparse.jagged_tensor",
        "sparse.jagged_tensor_validator",
        "sparse.tensor_dict",
        "streamable",
        "tensor_types",
        "types",
        "utils",
        "utils.experimental",
        "utils.percentile_logger",
    )
)

# --- issue 43 (h43a): packages whose only listed modules are their children -------------------------
#: ``torchrec.ir`` and ``torchrec.linter`` are packages of the listed ``ir.*`` / ``linter.*`` modules; without
#: them, ``import lightning_shardrec.ir.schema`` failed on the package with a bare ModuleNotFoundError
TORCHREC_MODULES = TORCHREC_MODULES | frozenset(("ir", "linter"))


#: TorchRec's module paths whose module lives elsewhere here (path -> module, both relative to the package).
#: A package row also serves its children (``distributed.planner.types``) unless a longer row names them.
ALIASES: dict[str, str] = {
    "datasets": "compat.torchrec.datasets",
    "distributed.embedding": "compat.torchrec.distributed.embedding",
    "distributed.embedding_types": "compat.torchrec.distributed.embedding_types",
    "distributed.embeddingbag": "compat.torchrec.distributed.embeddingbag",
    "distributed.fbgemm_qcomm_codec": "distributed.comm.fbgemm_qcomm_codec",
    "distributed.model_parallel": "distributed.dmp.model_parallel",
    "distributed.planner": "compat.torchrec.distributed.planner",
    "distributed.shard": "compat.torchrec.distributed.shard",
    "distributed.sharding_plan": "compat.torchrec.distributed.sharding_plan",
    "distributed.test_utils": "compat.torchrec.distributed.test_utils",
    "distributed.train_pipeline": "compat.torchrec.distributed.train_pipeline",
    "distributed.train_pipeline.train_pipelines": "distributed.pipelines.sparse_dist",
    "distributed.types": "compat.torchrec.distributed.types",
    "modules.embedding_modules": "compat.torchrec.modules.embedding_modules",
    "modules.mc_modules": "compat.torchrec.modules.mc_modules",
    "sparse.tests": "compat.torchrec.sparse.tests",
    "types": "compat.torchrec.types",
}
_PACKAGE = "lightning_shardrec"
_MIRRORS = "compat.torchrec."


def alias_target(path: str) -> str | None:
    """The module (relative to the package) that serves TorchRec's ``path``, or None when none does."""
    if path in ALIASES:
        return ALIASES[path]
    head = path
    while "." in head:
        head = head.rpartition(".")[0]
        if head in ALIASES:
            return ALIASES[head] + path[len(head) :]
    return None


class _AliasLoader(Loader):
    """Loads a path as the module object of another path (imported once, under its own name)."""

    def __init__(self, real: str) -> None:
        self.real = real
        self._spec: ModuleSpec | None = None

    def create_module(self, spec: ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.real)
        self._spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # the import system set the alias's spec on the module: give it back its own
        if self._spec is not None:
            module.__spec__ = self._spec


class TorchRecPathFinder:
    """Serves TorchRec's module paths from where they live here, refuses those this library lacks, by name;
    leaves every other import alone."""

    @staticmethod
    def find_spec(
        fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        head, _, rest = fullname.partition(".")
        if head != _PACKAGE or not rest:
            return None
        real = alias_target(rest)
        if rest.startswith(_MIRRORS):  # ``from <mirror package> import <child served elsewhere>`` asks for this
            real = alias_target(rest[len(_MIRRORS) :])
            real = None if real == rest else real
        if real is not None:
            try:
                found = importlib.util.find_spec(f"{_PACKAGE}.{real}")
            except ModuleNotFoundError:
                found = None
            if found is not None:
                return ModuleSpec(
                    fullname,
                    _AliasLoader(f"{_PACKAGE}.{real}"),
                    is_package=found.submodule_search_locations is not None,
                )
        if rest not in TORCHREC_MODULES or PathFinder.find_spec(fullname, path) is not None:
            return None
        raise MissingTorchRecFeatureError(
            f"{fullname} (TorchRec's torchrec.{rest}) is not provided by lightning_shardrec. "
            "See docs/migrating.md, 'Not provided' for what is, and what to use instead"
        )


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once): an alias must win over a file under an aliased package."""
    if not any(isinstance(f, TorchRecPathFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, TorchRecPathFinder())  # type: ignore[arg-type]
