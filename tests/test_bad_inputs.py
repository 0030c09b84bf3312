# ruff: noqa: E501  (the table rows and the case list read best one per line)
"""Bad input sweep (issue #13): every validated user-facing input, what it must raise, and where it is tested.

House rule: bad input raises a named error whose message names the feature/table, the value and
the valid range; never a silent wrong answer, a deep stack trace, a hang or a crash. Each row
below is a case in ``CASES``: the cheap ones run here (``test_bad_input_raises_named_error``),
the costly ones (multi-rank fits) point at the dedicated test that covers them, and
``test_table_in_docstring_matches_cases`` keeps this table in step with ``CASES``.
Rows marked **gap** are known holes, run as ``xfail(strict=True)`` until their owner fixes them.
The fuzz tests behind the KJT and Criteo rows: ``tests/sparse/test_kjt_fuzz.py``,
``tests/data/test_criteo_fuzz.py``.

<!-- table:start -->
| area | bad input | raises | also covered by |
| --- | --- | --- | --- |
| KeyedJaggedTensor | lengths sum > number of ids | ValueError | tests/sparse/test_keyed_jagged_tensor.py::test_lengths_sum_more_than_values |
| KeyedJaggedTensor | offsets span > number of ids | ValueError | tests/sparse/test_keyed_jagged_tensor.py::test_offsets_span_more_than_values |
| KeyedJaggedTensor | len(offsets) != len(lengths) + 1 | ValueError | tests/sparse/test_keyed_jagged_tensor.py::test_lengths_and_offsets_counts_disagree |
| KeyedJaggedTensor | offsets disagree with lengths | ValueError | tests/sparse/test_keyed_jagged_tensor.py::test_offsets_disagree_with_lengths_names_key |
| KeyedJaggedTensor | offsets do not start at 0 | ValueError | tests/sparse/test_keyed_jagged_tensor.py::test_offsets_only_must_start_at_zero |
| KeyedJaggedTensor | negative length (sum still right) | ValueError | tests/sparse/test_keyed_jagged_tensor.py::test_negative_length_names_key_at_construction_and_in_validate |
| KeyedJaggedTensor | fewer weights than ids | ValueError | tests/sparse/test_keyed_jagged_tensor.py::test_weights_of_wrong_size |
| KeyedJaggedTensor | 2-D weights | ValueError |  |
| ids | integer weights looked up by a weighted EmbeddingBagCollection | ValueError | tests/modules/test_lookup_checks.py::test_lookup_checks_ids_the_kjt_accepts |
| ids | float ids looked up | ValueError | tests/modules/test_lookup_checks.py::test_lookup_checks_ids_the_kjt_accepts |
| ids | 2-D ids looked up | ValueError | tests/modules/test_lookup_checks.py::test_lookup_checks_ids_the_kjt_accepts |
| KeyedJaggedTensor | float lengths | ValueError | tests/sparse/test_keyed_jagged_tensor.py::test_float_lengths_rejected |
| KeyedJaggedTensor | int16 lengths (would overflow) | ValueError |  |
| KeyedJaggedTensor | lengths do not divide into keys | ValueError | tests/sparse/test_keyed_jagged_tensor.py::test_key_count_does_not_divide_lengths |
| KeyedJaggedTensor | stride x keys != lengths | ValueError | tests/sparse/test_keyed_jagged_tensor.py::test_stride_mismatch |
| KeyedJaggedTensor | negative stride | ValueError |  |
| KeyedJaggedTensor | float stride | ValueError |  |
| KeyedJaggedTensor | repeated keys | ValueError | tests/sparse/test_keyed_jagged_tensor.py::test_duplicate_keys |
| KeyedJaggedTensor | keys given as one string | TypeError |  |
| KeyedJaggedTensor | non-str keys | TypeError |  |
| KeyedJaggedTensor | values not a tensor | TypeError |  |
| KeyedJaggedTensor | neither lengths nor offsets | ValueError | tests/sparse/test_keyed_jagged_tensor.py::test_needs_lengths_or_offsets |
| KeyedJaggedTensor | length_per_key disagrees with lengths | ValueError |  |
| KeyedJaggedTensor | unknown key lookup | KeyError | tests/sparse/test_keyed_jagged_tensor.py::test_getitem_unknown_key_lists_keys |
| KeyedJaggedTensor | split segments do not cover the keys | ValueError | tests/sparse/test_keyed_jagged_tensor.py::test_split_segments_wrong |
| KeyedJaggedTensor | permute index out of range | ValueError | tests/sparse/test_keyed_jagged_tensor.py::test_permute_out_of_range |
| JaggedTensor | lengths sum > number of values | ValueError | tests/sparse/test_jagged_tensor.py::test_lengths_sum_more_than_values |
| JaggedTensor | negative length | ValueError | tests/sparse/test_jagged_tensor.py::test_negative_length_rejected_at_construction_and_by_validate |
| JaggedTensor | fewer weights than values | ValueError | tests/sparse/test_jagged_tensor.py::test_weights_of_wrong_size |
| JaggedTensor | 0-d values | ValueError |  |
| JaggedTensor | float lengths | ValueError | tests/sparse/test_jagged_tensor.py::test_float_lengths_rejected |
| JaggedTensor | neither lengths nor offsets | ValueError | tests/sparse/test_jagged_tensor.py::test_needs_lengths_or_offsets |
| KeyedTensor | keys and length_per_key counts differ | ValueError |  |
| KeyedTensor | length_per_key sum != values width | ValueError | tests/sparse/test_keyed_tensor.py::test_values_without_key_dim |
| KeyedTensor | negative length_per_key | ValueError |  |
| KeyedTensor | repeated keys | ValueError |  |
| KeyedTensor | unknown key lookup | KeyError | tests/sparse/test_keyed_tensor.py::test_getitem_unknown_key |
| KeyedTensor | regroup names a missing key | KeyError | tests/sparse/test_keyed_tensor.py::test_regroup_missing_key |
| ids | id >= num_embeddings in EmbeddingBagCollection | ValueError | tests/modules/test_embedding_bag_collection.py::test_bad_id_names_feature_table_and_range |
| ids | negative id in EmbeddingBagCollection | ValueError | tests/modules/test_embedding_bag_collection.py::test_bad_id_names_feature_table_and_range |
| ids | bad id in the second feature of a table | ValueError | tests/modules/test_embedding_bag_collection.py::test_bad_id_in_second_feature_is_attributed_to_it |
| ids | id out of range in EmbeddingCollection | ValueError | tests/modules/test_embedding_collection.py::test_need_indices_and_bad_id |
| ids | bad id on one rank of a sharded model (DMP) | ValueError | tests/distributed/test_dmp.py::test_bad_input_on_one_rank_stops_every_rank_without_hanging |
| ids | bad id on one rank inside Trainer.fit | ValueError | tests/lightning/test_strategy_loops.py::test_bad_id_on_one_rank_stops_the_run |
| modules | KJT lacks a feature the collection needs | KeyError | tests/modules/test_embedding_bag_collection.py::test_missing_feature_is_named |
| modules | is_weighted=True but KJT has no weights | ValueError | tests/modules/test_embedding_bag_collection.py::test_weighted_needs_weights |
| modules | forward given a Tensor, not a KJT | TypeError |  |
| modules | two tables with one name | ValueError | tests/modules/test_embedding_bag_collection.py::test_duplicate_tables_rejected |
| modules | VBE KJT without inverse_indices | ValueError | tests/modules/test_vbe.py::test_vbe_without_inverse_indices_is_named |
| modules | no tables | ValueError | tests/modules/test_embedding_bag_collection.py::test_duplicate_tables_rejected |
| modules | EmbeddingConfig given to EmbeddingBagCollection's sibling | TypeError | tests/modules/test_embedding_collection.py::test_rejects_bag_configs |
| table config | embedding_dim 0 | ValueError | tests/test_configs.py::test_non_positive_dim |
| table config | num_embeddings not an int | ValueError | tests/test_configs.py::test_non_positive_rows |
| table config | empty name | ValueError | tests/test_configs.py::test_empty_name |
| table config | name not a str | ValueError |  |
| table config | feature_names a bare string | ValueError | tests/test_configs.py::test_empty_or_string_feature_names |
| table config | feature name not a str / empty | ValueError |  |
| table config | repeated feature name | ValueError | tests/test_configs.py::test_repeated_feature_names |
| table config | unknown pooling string | ValueError |  |
| table config | pooling NONE on a bag table | ValueError | tests/test_configs.py::test_pooling_none_on_bag_config |
| table config | unknown data_type string | ValueError |  |
| table config | weight_init_min above max | ValueError | tests/test_configs.py::test_init_min_above_max |
| table config | nan weight_init_max | ValueError |  |
| table config | num_embeddings_post_pruning out of range | ValueError |  |
| table config | TorchRec virtual-table field set | UnsupportedFeatureError | tests/test_configs.py::test_unimplemented_torchrec_fields_are_refused |
| FusedOptimConfig | unknown optimizer name | ValueError | tests/test_configs.py::test_fused_optim_unknown_optimizer |
| FusedOptimConfig | negative lr | ValueError | tests/test_configs.py::test_fused_optim_negative |
| FusedOptimConfig | nan lr | ValueError |  |
| FusedOptimConfig | lr given as a string | ValueError |  |
| FusedOptimConfig | beta1 outside [0, 1) | ValueError | tests/test_configs.py::test_fused_optim_beta_range |
| FusedOptimizer | state_dict for another number of tables | ValueError |  |
| FusedOptimizer | state tensor of the wrong shape | ValueError |  |
| constraints | unknown sharding type string | ValueError | tests/planner/test_types.py::test_unknown_sharding_type_lists_choices |
| constraints | unknown compute kernel string | ValueError | tests/planner/test_types.py::test_unknown_kernel_lists_choices |
| constraints | min_partition 0 | ValueError | tests/planner/test_types.py::test_bad_constraints |
| constraints | pinned rank negative | ValueError | tests/planner/test_types.py::test_bad_constraints |
| constraints | pinned ranks outside the world | PlannerError | tests/planner/test_planner.py::test_pinned_ranks_outside_world |
| constraints | constraints name an unknown table | PlannerError | tests/planner/test_planner.py::test_constraints_for_unknown_table_list_available |
| constraints | pooling_factors not numbers | ValueError |  |
| constraints | nan pooling factor | ValueError |  |
| ShardingPlan | JSON of another document | ValueError | tests/planner/test_plan_io.py::test_from_json_rejects_other_documents |
| ShardingPlan | malformed JSON text | ValueError |  |
| ShardingPlan | a table entry lacks compute_kernel | ValueError |  |
| ShardingPlan | module entry not an object | ValueError |  |
| ShardingPlan | fixed plan names a table not in the model | PlannerError | tests/planner/test_plan_io.py::test_fixed_plan_unknown_table |
| ShardingPlan | fixed plan invalid for the table (ranks vs shards) | PlannerError | tests/planner/test_plan_io.py::test_invalid_fixed_plan_rejected |
| ShardingPlan | fixed plan over a rank's memory | PlannerError | tests/planner/test_plan_io.py::test_fixed_plan_over_memory |
| ShardingPlan | ShardMetadata offsets not (row, col) | ValueError | tests/planner/test_types.py::test_shard_metadata_needs_pairs |
| Topology | world_size 0 | ValueError | tests/planner/test_topology.py::test_bad_topology |
| Topology | unknown compute_device | ValueError | tests/planner/test_topology.py::test_bad_topology |
| Topology | local_world_size not dividing world_size | ValueError | tests/planner/test_topology.py::test_bad_topology |
| planner | batch_size 0 | ValueError | tests/planner/test_planner.py::test_bad_batch_size |
| planner | reserve 1.0 (no memory left for tables) | ValueError | tests/planner/test_memory.py::test_bad_reserve |
| planner | TorchRec proposer given | UnsupportedFeatureError | tests/planner/test_planner_api.py::test_unimplemented_parts_are_refused_by_name |
| planner | pinned plan passed as sharders | TypeError | tests/planner/test_planner_api.py::test_pinned_plan_goes_by_keyword |
| planner | tables too big for every rank | PlannerError | tests/planner/test_planner.py::test_infeasible_names_every_table_and_capacity |
| kernels | unknown kernel backend name | ValueError | tests/kernels/test_kernels.py::test_kernel_errors_list_choices |
| kernels | fbgemm on CPU asked for adam | ValueError | tests/kernels/test_kernels.py::test_kernel_errors_list_choices |
| strategy | unknown checkpoint_format | ValueError |  |
| strategy | unknown kernel | ValueError | tests/lightning/test_strategy_errors.py::test_bad_settings_fail_with_choices |
| strategy | unknown embedding_optimizer | ValueError | tests/lightning/test_strategy_errors.py::test_bad_settings_fail_with_choices |
| strategy | negative embedding_lr | ValueError |  |
| strategy | planner_batch_size 0 | ValueError |  |
| strategy | planner_reserve 1.5 | ValueError |  |
| strategy | clip_gradients by norm from a hook the strategy was not told of | ValueError | tests/lightning/test_strategy_habits.py::test_a_norm_clip_the_strategy_was_not_told_of_is_refused_by_name |
| optim | DeferredTableUpdates over fbgemm kernels | ValueError | tests/optim/test_deferred_table_updates.py::test_fbgemm_kernels_are_refused_by_name |
| strategy | optimizer with no fused form (SGD momentum) | ValueError | tests/lightning/test_strategy_errors.py::test_derived_optimizers |
| Criteo TSV | wrong column count | ValueError | tests/data/test_criteo_reader.py::test_bad_line_errors_name_file_and_line |
| Criteo TSV | non-hex categorical | ValueError | tests/data/test_criteo_reader.py::test_bad_line_errors_name_file_and_line |
| Criteo TSV | non-integer dense value | ValueError | tests/data/test_criteo_reader.py::test_bad_line_errors_name_file_and_line |
| Criteo TSV | label not 0/1 | ValueError | tests/data/test_criteo_reader.py::test_bad_line_errors_name_file_and_line |
| Criteo TSV | dense value beyond 64 bits | ValueError |  |
| Criteo TSV | truncated gzip | ValueError | tests/data/test_criteo_reader.py::test_truncated_gzip_errors_or_is_skipped |
| Criteo TSV | empty .gz file | ValueError |  |
| Criteo TSV | unknown on_bad_line | ValueError | tests/data/test_criteo_reader.py::test_reader_argument_errors |
| Criteo TSV | wrong number of table sizes | ValueError | tests/data/test_criteo_reader.py::test_reader_argument_errors |
| Criteo binary | no meta.json | ValueError | tests/data/test_criteo_binary.py::test_splits_and_errors |
| Criteo binary | corrupt meta.json | ValueError |  |
| Criteo binary | .npy shorter than meta.json says | ValueError |  |
| Criteo binary | format version mismatch | ValueError | tests/data/test_criteo_binary.py::test_format_version_mismatch |
| DataModule | batch_size 0 | ValueError | tests/data/test_datamodules.py::test_synthetic_datamodule_errors |
| DataModule | Criteo val+test fraction >= 1 | ValueError | tests/data/test_datamodules.py::test_criteo_datamodule_errors |
| DataModule | RecBatch dense rows != labels | ValueError | tests/data/test_recbatch.py::test_shape_errors |
| CLI | unknown sharding type in constraints | SystemExit |  |
| CLI | unknown kernel | ValueError |  |
| CLI | plan CLI with a bad tables file | SystemExit | tests/planner/test_plan_io.py::test_cli_reports_errors |
<!-- table:end -->
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import os
import re
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_shardrec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingShardingPlanner,
    FusedOptimConfig,
    JaggedTensor,
    KeyedJaggedTensor,
    KeyedTensor,
    ParameterConstraints,
    ShardingPlan,
    Topology,
)
from lightning_shardrec.errors import PlannerError, UnsupportedFeatureError

ROOT = Path(__file__).resolve().parents[1]
T = torch.tensor


@dataclass(frozen=True)
class Case:
    """One bad input: where, what is wrong, how to trigger it, what it raises, where else it is tested."""

    area: str
    wrong: str
    trigger: Callable[[], object] | None  # None: too costly here (multi-rank); see covered_by
    error: type[BaseException]
    match: str  # regex on the message: names the feature/table/argument and the value/range
    covered_by: str = ""  # "tests/<file>.py::<test>" of a dedicated test
    gap: str = ""  # a known hole: the case runs as xfail(strict=True) with this reason


# --- triggers ---------------------------------------------------------------------------------
def _kjt(keys: list[str] = ["a", "b"], values: object = None, **kw: object) -> KeyedJaggedTensor:  # noqa: B006
    values = T([1, 2, 3]) if values is None else values
    return KeyedJaggedTensor(keys, values, **kw)  # type: ignore[arg-type]


def _ebc(is_weighted: bool = False) -> EmbeddingBagCollection:
    tables = [
        EmbeddingBagConfig(num_embeddings=10, embedding_dim=4, name="t_user", feature_names=["user"]),
        EmbeddingBagConfig(num_embeddings=5, embedding_dim=4, name="t_ad", feature_names=["ad", "ad2"]),
    ]
    return EmbeddingBagCollection(tables, is_weighted=is_weighted)


def _ebc_forward(user: list[int], ad: list[int], ad2: list[int]) -> object:
    values = T(user + ad + ad2)
    return _ebc()(KeyedJaggedTensor(["user", "ad", "ad2"], values, lengths=T([len(user), len(ad), len(ad2)])))


def _bag(**kw: object) -> EmbeddingBagConfig:
    args: dict[str, object] = {"num_embeddings": 10, "embedding_dim": 4, "name": "t_user", "feature_names": ["user"]}
    args.update(kw)
    return EmbeddingBagConfig(**args)  # type: ignore[arg-type]


def _fused_optimizer_load(state: dict[str, object]) -> None:
    from lightning_shardrec.kernels import TableSpec, make_kernel
    from lightning_shardrec.optim import FusedOptimizer

    config = FusedOptimConfig(optimizer="adagrad")
    kernel = make_kernel([TableSpec(name="t_user", num_embeddings=5, embedding_dim=4)], [0], config, pooled=True, device="cpu", kernel="torch")
    FusedOptimizer([kernel], config).load_state_dict(state)


def _plan(constraints: dict[str, ParameterConstraints], world: int = 2) -> object:
    tables = {"ebc": [_bag(name="t_user", num_embeddings=1000)]}
    return EmbeddingShardingPlanner(Topology(world), constraints=constraints).plan(tables)


def _strategy(**kw: object) -> object:
    from lightning_shardrec import ShardRecStrategy

    return ShardRecStrategy(**kw)  # type: ignore[arg-type]


def _line(label: str = "1", dense: list[str] | None = None, cats: list[str] | None = None) -> str:
    dense = ["1"] * 13 if dense is None else dense
    cats = ["68fd1e64"] * 26 if cats is None else cats
    return "\t".join([label, *dense, *cats])


def _read_criteo(lines: list[str], name: str = "day_0") -> int:
    """Write ``lines`` to a temporary Criteo file and read it all; the row count."""
    from lightning_shardrec.data.criteo import CriteoReader

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / name
        data = ("\n".join(lines) + "\n").encode()
        path.write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
        return sum(len(c) for c in CriteoReader(path, num_embeddings=100))


def _read_empty_gz() -> int:
    from lightning_shardrec.data.criteo import CriteoReader

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "day_1.gz"
        path.write_bytes(b"")
        return sum(len(c) for c in CriteoReader(path))


def _open_corrupt_binary(corrupt: Callable[[Path], None]) -> object:
    """Preprocess two good lines, apply ``corrupt`` to the directory, open it."""
    from lightning_shardrec.data.criteo_binary import CriteoBinary, preprocess_criteo

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "day_0"
        src.write_text(_line() + "\n" + _line("0") + "\n")
        preprocess_criteo([src], Path(tmp) / "p", num_embeddings=100)
        corrupt(Path(tmp) / "p")
        return CriteoBinary(Path(tmp) / "p")


def _truncate_npy(root: Path) -> None:
    arr = np.load(root / "day_0.sparse.npy")
    np.save(root / "day_0.sparse.npy", arr[:1])


def _cli(*args: str) -> object:
    """Build the ``shardrec`` CLI in-process on the DLRM config; a parse error re-raised with its text."""
    from lightning_shardrec.cli import run_cli

    buf, argv, environ = io.StringIO(), sys.argv, dict(os.environ)
    sys.argv = ["shardrec"]
    try:
        with contextlib.redirect_stderr(buf):
            return run_cli(["--config", str(ROOT / "examples" / "dlrm" / "config.yaml"), *args], run=False)
    except SystemExit as e:
        raise SystemExit(f"exit {e.code}: {buf.getvalue()}") from None
    finally:  # the config's seed_everything sets PL_GLOBAL_SEED; leave the process as it was
        sys.argv = argv
        os.environ.clear()
        os.environ.update(environ)


_STRATEGY = "--trainer.strategy=lightning_shardrec.ShardRecStrategy"
_KJT = "tests/sparse/test_keyed_jagged_tensor.py::"
_JT = "tests/sparse/test_jagged_tensor.py::"
_KT = "tests/sparse/test_keyed_tensor.py::"
_EBC = "tests/modules/test_embedding_bag_collection.py::"
_LOOKUP = "tests/modules/test_lookup_checks.py::"
_CFG = "tests/test_configs.py::"
_PLAN = "tests/planner/"
_READER = "tests/data/test_criteo_reader.py::"

CASES: list[Case] = [
    # --- KeyedJaggedTensor ---------------------------------------------------------------------
    Case("KeyedJaggedTensor", "lengths sum > number of ids", lambda: _kjt(lengths=T([2, 2])),
         ValueError, r"KeyedJaggedTensor\(keys=\['a', 'b'\]\): lengths sum to 4 but there are 3 values",
         _KJT + "test_lengths_sum_more_than_values"),
    Case("KeyedJaggedTensor", "offsets span > number of ids", lambda: _kjt(offsets=T([0, 1, 4])),
         ValueError, r"keys=\['a', 'b'\]\): offsets span 4 values but there are 3",
         _KJT + "test_offsets_span_more_than_values"),
    Case("KeyedJaggedTensor", "len(offsets) != len(lengths) + 1",
         lambda: _kjt(lengths=T([1, 2]), offsets=T([0, 3])),
         ValueError, r"2 offsets disagree with 2 lengths \(offsets need len\(lengths\) \+ 1 = 3\)",
         _KJT + "test_lengths_and_offsets_counts_disagree"),
    Case("KeyedJaggedTensor", "offsets disagree with lengths",
         lambda: _kjt(lengths=T([1, 2]), offsets=T([0, 2, 3])),
         ValueError, r"offsets disagree with lengths at key 'a' \(bag 0 of 1\): offsets give 2, lengths give 1",
         _KJT + "test_offsets_disagree_with_lengths_names_key"),
    Case("KeyedJaggedTensor", "offsets do not start at 0", lambda: _kjt(offsets=T([1, 2, 4])),
         ValueError, r"keys=\['a', 'b'\]\): offsets must start at 0, got 1",
         _KJT + "test_offsets_only_must_start_at_zero"),
    Case("KeyedJaggedTensor", "negative length (sum still right)", lambda: _kjt(lengths=T([4, -1])),
         ValueError, r"negative length -1 at key 'b' \(bag 0 of 1\); lengths must be >= 0",
         _KJT + "test_negative_length_names_key_at_construction_and_in_validate"),
    Case("KeyedJaggedTensor", "fewer weights than ids", lambda: _kjt(weights=torch.ones(2), lengths=T([1, 2])),
         ValueError, r"keys=\['a', 'b'\]\): 2 weights for 3 values \(need one per value\)",
         _KJT + "test_weights_of_wrong_size"),
    Case("KeyedJaggedTensor", "2-D weights", lambda: _kjt(weights=torch.ones(3, 1), lengths=T([1, 2])),
         ValueError, r"keys=\['a', 'b'\]\): weights must be a 1-D tensor \(one per value\), got shape \(3, 1\)"),
    Case("ids", "integer weights looked up by a weighted EmbeddingBagCollection",
         lambda: _ebc(is_weighted=True)(KeyedJaggedTensor(["user", "ad", "ad2"], T([1, 1, 1]), T([1, 1, 1]), T([1, 1, 1]))),
         ValueError, r"EmbeddingBagCollection\(is_weighted=True\): weights must be a 1-D float tensor .*dtype torch.int64",
         _LOOKUP + "test_lookup_checks_ids_the_kjt_accepts"),
    Case("ids", "float ids looked up", lambda: _ebc()(KeyedJaggedTensor(["user", "ad", "ad2"], T([1.0, 2.0, 3.0]), lengths=T([1, 1, 1]))),
         ValueError, r"EmbeddingBagCollection: KeyedJaggedTensor ids must be integers, got dtype torch.float32 for keys \['user', 'ad', 'ad2'\]",
         _LOOKUP + "test_lookup_checks_ids_the_kjt_accepts"),
    Case("ids", "2-D ids looked up", lambda: _ebc()(KeyedJaggedTensor(["user", "ad", "ad2"], T([[1, 2]] * 3), lengths=T([1, 1, 1]))),
         ValueError, r"EmbeddingBagCollection: KeyedJaggedTensor values must be 1-D ids, got shape \(3, 2\)",
         _LOOKUP + "test_lookup_checks_ids_the_kjt_accepts"),
    Case("KeyedJaggedTensor", "float lengths", lambda: _kjt(lengths=T([1.0, 2.0])),
         ValueError, r"keys=\['a', 'b'\]\): lengths must be an integer tensor, got dtype torch.float32",
         _KJT + "test_float_lengths_rejected"),
    Case("KeyedJaggedTensor", "int16 lengths (would overflow)", lambda: _kjt(lengths=T([1, 2], dtype=torch.int16)),
         ValueError, r"lengths must be an integer tensor, got dtype torch.int16 \(use int32 or int64\)"),
    Case("KeyedJaggedTensor", "lengths do not divide into keys", lambda: _kjt(lengths=T([1, 1, 1])),
         ValueError, r"3 lengths do not divide into 2 keys \['a', 'b'\]",
         _KJT + "test_key_count_does_not_divide_lengths"),
    Case("KeyedJaggedTensor", "stride x keys != lengths", lambda: _kjt(lengths=T([1, 1, 1, 0]), stride=3),
         ValueError, r"stride 3 x 2 keys \['a', 'b'\] needs 6 lengths, got 4", _KJT + "test_stride_mismatch"),
    Case("KeyedJaggedTensor", "negative stride", lambda: _kjt([], T([], dtype=torch.int64), lengths=T([], dtype=torch.int64), stride=-1),
         ValueError, r"stride \(batch size\) must be an int >= 0, got -1"),
    Case("KeyedJaggedTensor", "float stride", lambda: _kjt(lengths=T([1, 2]), stride=1.0),
         ValueError, r"keys=\['a', 'b'\]\): stride \(batch size\) must be an int >= 0, got 1.0"),
    Case("KeyedJaggedTensor", "repeated keys", lambda: _kjt(["a", "a"], lengths=T([1, 2])),
         ValueError, r"keys must be unique, repeated: \['a'\]", _KJT + "test_duplicate_keys"),
    Case("KeyedJaggedTensor", "keys given as one string", lambda: _kjt("ab", lengths=T([1, 2])),  # type: ignore[arg-type]
         TypeError, r"keys must be a list of feature names, got 'ab'"),
    Case("KeyedJaggedTensor", "non-str keys", lambda: _kjt([1, 2], lengths=T([1, 2])),  # type: ignore[list-item]
         TypeError, r"keys must be str, got \[1, 2\]"),
    Case("KeyedJaggedTensor", "values not a tensor", lambda: _kjt(values=[1, 2, 3], lengths=T([1, 2])),
         TypeError, r"keys=\['a', 'b'\]\): values must be a torch.Tensor, got list"),
    Case("KeyedJaggedTensor", "neither lengths nor offsets", lambda: _kjt(),
         ValueError, r"KeyedJaggedTensor\(keys=\['a', 'b'\]\) needs lengths or offsets",
         _KJT + "test_needs_lengths_or_offsets"),
    Case("KeyedJaggedTensor", "length_per_key disagrees with lengths",
         lambda: _kjt(lengths=T([1, 2]), length_per_key=[2, 1]),
         ValueError, r"length_per_key \[2, 1\] but the lengths give \[1, 2\]"),
    Case("KeyedJaggedTensor", "unknown key lookup", lambda: _kjt(lengths=T([1, 2]))["c"],
         KeyError, r"key 'c' not in KeyedJaggedTensor keys \['a', 'b'\]", _KJT + "test_getitem_unknown_key_lists_keys"),
    Case("KeyedJaggedTensor", "split segments do not cover the keys", lambda: _kjt(lengths=T([1, 2])).split([1]),
         ValueError, r"split segments \[1\] must be non-negative and sum to 2 keys", _KJT + "test_split_segments_wrong"),
    Case("KeyedJaggedTensor", "permute index out of range", lambda: _kjt(lengths=T([1, 2])).permute([0, 2]),
         ValueError, r"permute indices \[2\] outside \[0, 2\) for keys \['a', 'b'\]", _KJT + "test_permute_out_of_range"),
    # --- JaggedTensor / KeyedTensor ----------------------------------------------------------------
    Case("JaggedTensor", "lengths sum > number of values", lambda: JaggedTensor(T([1, 2, 3]), lengths=T([2, 2])),
         ValueError, r"JaggedTensor: lengths sum to 4 but there are 3 values",
         _JT + "test_lengths_sum_more_than_values"),
    Case("JaggedTensor", "negative length", lambda: JaggedTensor(T([1, 2]), lengths=T([3, -1])),
         ValueError, r"JaggedTensor: negative length -1 at bag 1; lengths must be >= 0",
         _JT + "test_negative_length_rejected_at_construction_and_by_validate"),
    Case("JaggedTensor", "fewer weights than values",
         lambda: JaggedTensor(T([1, 2]), weights=torch.ones(1), lengths=T([2])),
         ValueError, r"JaggedTensor: 1 weights for 2 values", _JT + "test_weights_of_wrong_size"),
    Case("JaggedTensor", "0-d values", lambda: JaggedTensor(T(1), lengths=T([1])),
         ValueError, r"JaggedTensor: values must have one entry per value, got a 0-d tensor"),
    Case("JaggedTensor", "float lengths", lambda: JaggedTensor(T([1, 2]), lengths=T([2.0])),
         ValueError, r"JaggedTensor: lengths must be an integer tensor, got dtype torch.float32",
         _JT + "test_float_lengths_rejected"),
    Case("JaggedTensor", "neither lengths nor offsets", lambda: JaggedTensor(T([1])),
         ValueError, r"JaggedTensor needs lengths or offsets \(got neither\)", _JT + "test_needs_lengths_or_offsets"),
    Case("KeyedTensor", "keys and length_per_key counts differ", lambda: KeyedTensor(["a", "b"], [2], torch.zeros(1, 2)),
         ValueError, r"KeyedTensor: 2 keys but 1 lengths"),
    Case("KeyedTensor", "length_per_key sum != values width", lambda: KeyedTensor(["a"], [3], torch.zeros(2, 2)),
         ValueError, r"length_per_key \[3\] sums to 3 but values has shape \(2, 2\) \(key_dim=1\)",
         _KT + "test_values_without_key_dim"),
    Case("KeyedTensor", "negative length_per_key", lambda: KeyedTensor(["a", "b"], [3, -1], torch.zeros(1, 2)),
         ValueError, r"KeyedTensor: length_per_key must be ints >= 0, got \{'b': -1\}"),
    Case("KeyedTensor", "repeated keys", lambda: KeyedTensor(["a", "a"], [1, 1], torch.zeros(1, 2)),
         ValueError, r"KeyedTensor keys must be unique, repeated: \['a'\]"),
    Case("KeyedTensor", "unknown key lookup", lambda: KeyedTensor(["a"], [2], torch.zeros(1, 2))["b"],
         KeyError, r"key 'b' not in KeyedTensor keys \['a'\]", _KT + "test_getitem_unknown_key"),
    Case("KeyedTensor", "regroup names a missing key",
         lambda: KeyedTensor.regroup([KeyedTensor(["a"], [2], torch.zeros(1, 2))], [["a", "z"]]),
         KeyError, r"regroup: keys \['z'\] are in none of the KeyedTensors \(have \['a'\]\)", _KT + "test_regroup_missing_key"),
    # --- ids out of range ---------------------------------------------------------------------------
    Case("ids", "id >= num_embeddings in EmbeddingBagCollection", lambda: _ebc_forward([10], [0], [0]),
         ValueError, r"feature 'user' \(table 't_user'\): id 10 outside \[0, 10\)",
         _EBC + "test_bad_id_names_feature_table_and_range"),
    Case("ids", "negative id in EmbeddingBagCollection", lambda: _ebc_forward([0], [-3], [0]),
         ValueError, r"feature 'ad' \(table 't_ad'\): id -3 outside \[0, 5\)",
         _EBC + "test_bad_id_names_feature_table_and_range"),
    Case("ids", "bad id in the second feature of a table", lambda: _ebc_forward([9], [4], [5]),
         ValueError, r"feature 'ad2' \(table 't_ad'\): id 5 outside \[0, 5\)",
         _EBC + "test_bad_id_in_second_feature_is_attributed_to_it"),
    Case("ids", "id out of range in EmbeddingCollection", None, ValueError, r"feature 'f' \(table 't'\): id 5",
         "tests/modules/test_embedding_collection.py::test_need_indices_and_bad_id"),
    Case("ids", "bad id on one rank of a sharded model (DMP)", None, ValueError, "outside",
         "tests/distributed/test_dmp.py::test_bad_input_on_one_rank_stops_every_rank_without_hanging"),
    Case("ids", "bad id on one rank inside Trainer.fit", None, ValueError, r"id 1000000 outside \[0, 120\)",
         "tests/lightning/test_strategy_loops.py::test_bad_id_on_one_rank_stops_the_run"),
    # --- modules ------------------------------------------------------------------------------------
    Case("modules", "KJT lacks a feature the collection needs",
         lambda: _ebc()(KeyedJaggedTensor(["user", "ad"], T([1, 2]), lengths=T([1, 1]))),
         KeyError, r"EmbeddingBagCollection: input KeyedJaggedTensor lacks features \['ad2'\]",
         _EBC + "test_missing_feature_is_named"),
    Case("modules", "is_weighted=True but KJT has no weights", None, ValueError, "is_weighted=True.*without weights",
         _EBC + "test_weighted_needs_weights"),
    Case("modules", "forward given a Tensor, not a KJT", lambda: _ebc()(T([1, 2])),
         TypeError, r"EmbeddingBagCollection.forward takes a KeyedJaggedTensor of features \['user', 'ad', 'ad2'\], "
         r"got Tensor"),
    Case("modules", "two tables with one name", lambda: EmbeddingBagCollection([_bag(), _bag(feature_names=["x"])]),
         ValueError, r"EmbeddingBagCollection: table names repeat: \['t_user'\]",
         _EBC + "test_duplicate_tables_rejected"),
    Case("modules", "VBE KJT without inverse_indices", None, ValueError, "without inverse_indices",
         "tests/modules/test_vbe.py::test_vbe_without_inverse_indices_is_named"),
    Case("modules", "no tables", lambda: EmbeddingBagCollection([]),
         ValueError, r"EmbeddingBagCollection needs at least one EmbeddingBagConfig",
         _EBC + "test_duplicate_tables_rejected"),
    Case("modules", "EmbeddingConfig given to EmbeddingBagCollection's sibling", None, TypeError, "takes EmbeddingConfig",
         "tests/modules/test_embedding_collection.py::test_rejects_bag_configs"),
    # --- table configs ------------------------------------------------------------------------------
    Case("table config", "embedding_dim 0", lambda: _bag(embedding_dim=0),
         ValueError, r"EmbeddingBagConfig\(name='t_user'\): embedding_dim must be a positive int, got 0",
         _CFG + "test_non_positive_dim"),
    Case("table config", "num_embeddings not an int", lambda: _bag(num_embeddings=10.5),
         ValueError, r"\(name='t_user'\): num_embeddings must be a positive int, got 10.5", _CFG + "test_non_positive_rows"),
    Case("table config", "empty name", lambda: _bag(name=""),
         ValueError, r"EmbeddingBagConfig needs a table name \(got name=''\)", _CFG + "test_empty_name"),
    Case("table config", "name not a str", lambda: _bag(name=3),
         ValueError, r"EmbeddingBagConfig: name must be a str, got 3"),
    Case("table config", "feature_names a bare string", lambda: _bag(feature_names="user"),
         ValueError, r"\(name='t_user'\): feature_names must be a non-empty list of feature names, got 'user'",
         _CFG + "test_empty_or_string_feature_names"),
    Case("table config", "feature name not a str / empty", lambda: _bag(feature_names=["user", ""]),
         ValueError, r"\(name='t_user'\): feature_names must be non-empty strings, got \[''\]"),
    Case("table config", "repeated feature name", lambda: _bag(feature_names=["u", "u"]),
         ValueError, r"\(name='t_user'\): feature_names repeat a name", _CFG + "test_repeated_feature_names"),
    Case("table config", "unknown pooling string", lambda: _bag(pooling="max"),
         ValueError, r"\(name='t_user'\): pooling must be one of SUM, MEAN, NONE; got 'max'"),
    Case("table config", "pooling NONE on a bag table", lambda: _bag(pooling="none"),
         ValueError, r"\(name='t_user'\): pooling NONE is not a pooled table", _CFG + "test_pooling_none_on_bag_config"),
    Case("table config", "unknown data_type string", lambda: _bag(data_type="fp64"),
         ValueError, r"\(name='t_user'\): data_type must be one of FP32, FP16, BF16, INT8, INT4, INT2; got 'fp64'"),
    Case("table config", "weight_init_min above max", lambda: _bag(weight_init_min=0.5, weight_init_max=0.1),
         ValueError, r"\(name='t_user'\): weight_init_min 0.5 is above weight_init_max 0.1", _CFG + "test_init_min_above_max"),
    Case("table config", "nan weight_init_max", lambda: _bag(weight_init_max=float("nan")),
         ValueError, r"\(name='t_user'\): weight_init_max must be a finite number or None, got nan"),
    Case("table config", "num_embeddings_post_pruning out of range", lambda: _bag(num_embeddings_post_pruning=11),
         ValueError, r"\(name='t_user'\): num_embeddings_post_pruning must be an int in \[1, 10\] or None, got 11"),
    Case("table config", "TorchRec virtual-table field set", lambda: _bag(use_virtual_table=True),
         UnsupportedFeatureError, r"\(name='t_user'\): use_virtual_table=True is not supported",
         _CFG + "test_unimplemented_torchrec_fields_are_refused"),
    # --- optimizer configs --------------------------------------------------------------------------
    Case("FusedOptimConfig", "unknown optimizer name", lambda: FusedOptimConfig(optimizer="lamb"),
         ValueError, r"unknown embedding optimizer 'lamb'; available: sgd, adagrad, rowwise_adagrad, adam, adamw",
         _CFG + "test_fused_optim_unknown_optimizer"),
    Case("FusedOptimConfig", "negative lr", lambda: FusedOptimConfig(lr=-0.5),
         ValueError, r"FusedOptimConfig: lr must be >= 0, got -0.5", _CFG + "test_fused_optim_negative"),
    Case("FusedOptimConfig", "nan lr", lambda: FusedOptimConfig(lr=float("nan")),
         ValueError, r"FusedOptimConfig: lr must be a finite number, got nan"),
    Case("FusedOptimConfig", "lr given as a string", lambda: FusedOptimConfig(lr="0.1"),  # type: ignore[arg-type]
         ValueError, r"FusedOptimConfig: lr must be a finite number, got '0.1'"),
    Case("FusedOptimConfig", "beta1 outside [0, 1)", lambda: FusedOptimConfig(beta1=1.0),
         ValueError, r"FusedOptimConfig: beta1 must be in \[0, 1\), got 1.0", _CFG + "test_fused_optim_beta_range"),
    Case("FusedOptimizer", "state_dict for another number of tables",
         lambda: _fused_optimizer_load({"state": {}, "param_groups": [{"params": [0, 1]}]}),
         ValueError, r"FusedOptimizer state_dict is for 2 tables, this optimizer has 1 \(\['t_user'\]\)"),
    Case("FusedOptimizer", "state tensor of the wrong shape",
         lambda: _fused_optimizer_load({"state": {0: {"sum": torch.zeros(6, 4)}}, "param_groups": [
             {"params": [0], **FusedOptimConfig().__dict__, "optimizer": "adagrad"}]}),
         ValueError, r"table 't_user': state 'sum' has shape \(6, 4\), expected \(5, 4\)"),
    # --- planner inputs -----------------------------------------------------------------------------
    Case("constraints", "unknown sharding type string", lambda: ParameterConstraints(sharding_types=["diagonal"]),
         ValueError, r"unknown sharding type 'diagonal'; available: table_wise, row_wise",
         _PLAN + "test_types.py::test_unknown_sharding_type_lists_choices"),
    Case("constraints", "unknown compute kernel string", lambda: ParameterConstraints(compute_kernels=["uvm"]),
         ValueError, r"unknown compute kernel 'uvm'; available: fused, dense",
         _PLAN + "test_types.py::test_unknown_kernel_lists_choices"),
    Case("constraints", "min_partition 0", lambda: ParameterConstraints(min_partition=0),
         ValueError, r"ParameterConstraints: min_partition must be a positive int, got 0",
         _PLAN + "test_types.py::test_bad_constraints"),
    Case("constraints", "pinned rank negative", lambda: ParameterConstraints(ranks=[-1]),
         ValueError, r"ParameterConstraints: ranks must be a non-empty list of ints >= 0, got \[-1\]",
         _PLAN + "test_types.py::test_bad_constraints"),
    Case("constraints", "pinned ranks outside the world", lambda: _plan({"t_user": ParameterConstraints(ranks=[5])}),
         PlannerError, r"table 't_user' \(module 'ebc'\): pinned ranks \[5\] are outside \[0, 2\)",
         _PLAN + "test_planner.py::test_pinned_ranks_outside_world"),
    Case("constraints", "constraints name an unknown table", lambda: _plan({"t_nope": ParameterConstraints()}),
         PlannerError, r"constraints name unknown tables \['t_nope'\]; available: t_user",
         _PLAN + "test_planner.py::test_constraints_for_unknown_table_list_available"),
    Case("constraints", "pooling_factors not numbers", lambda: ParameterConstraints(pooling_factors=["abc"]),  # type: ignore[list-item]
         ValueError, r"ParameterConstraints: pooling_factors .*'abc'"),
    Case("constraints", "nan pooling factor", lambda: ParameterConstraints(pooling_factors=[float("nan")]),
         ValueError, r"ParameterConstraints: pooling_factors .*nan"),
    Case("ShardingPlan", "JSON of another document", lambda: ShardingPlan.from_json("[]"),
         ValueError, r'ShardingPlan.from_json: expected an object with a "plan" key',
         _PLAN + "test_plan_io.py::test_from_json_rejects_other_documents"),
    Case("ShardingPlan", "malformed JSON text", lambda: ShardingPlan.from_json('{"plan": '),
         ValueError, r"ShardingPlan.from_json"),
    Case("ShardingPlan", "a table entry lacks compute_kernel",
         lambda: ShardingPlan.from_json(json.dumps({"plan": {"ebc": {"t_user": {
             "sharding_type": "table_wise", "ranks": [0], "shards": []}}}})),
         ValueError, r"t_user.*compute_kernel"),
    Case("ShardingPlan", "module entry not an object", lambda: ShardingPlan.from_json('{"plan": {"ebc": []}}'),
         ValueError, r"ebc"),
    Case("ShardingPlan", "fixed plan names a table not in the model", None, PlannerError, "is not in the model",
         _PLAN + "test_plan_io.py::test_fixed_plan_unknown_table"),
    Case("ShardingPlan", "fixed plan invalid for the table (ranks vs shards)", None, PlannerError, "differ from",
         _PLAN + "test_plan_io.py::test_invalid_fixed_plan_rejected"),
    Case("ShardingPlan", "fixed plan over a rank's memory", None, PlannerError, "capacity",
         _PLAN + "test_plan_io.py::test_fixed_plan_over_memory"),
    Case("ShardingPlan", "ShardMetadata offsets not (row, col)", None, ValueError, r"\(row, col\) pairs",
         _PLAN + "test_types.py::test_shard_metadata_needs_pairs"),
    Case("Topology", "world_size 0", lambda: Topology(0),
         ValueError, r"Topology: world_size must be a positive int, got 0", _PLAN + "test_topology.py::test_bad_topology"),
    Case("Topology", "unknown compute_device", lambda: Topology(2, compute_device="tpu"),
         ValueError, r"unknown compute device 'tpu'; available: cpu, cuda", _PLAN + "test_topology.py::test_bad_topology"),
    Case("Topology", "local_world_size not dividing world_size", lambda: Topology(8, local_world_size=3),
         ValueError, r"local_world_size must be a positive int dividing world_size 8, got 3",
         _PLAN + "test_topology.py::test_bad_topology"),
    Case("planner", "batch_size 0", lambda: EmbeddingShardingPlanner(Topology(2), batch_size=0),
         ValueError, r"batch_size must be a positive int, got 0", _PLAN + "test_planner.py::test_bad_batch_size"),
    Case("planner", "reserve 1.0 (no memory left for tables)", lambda: EmbeddingShardingPlanner(Topology(2), reserve=1.0),
         ValueError, r"reserve is the fraction of each rank's memory kept free .* in \[0, 1\), got 1\.0",
         _PLAN + "test_memory.py::test_bad_reserve"),
    Case("planner", "TorchRec proposer given", lambda: EmbeddingShardingPlanner(Topology(2), proposer=object()),
         UnsupportedFeatureError, r"EmbeddingShardingPlanner: proposer=object is not supported",
         _PLAN + "test_planner_api.py::test_unimplemented_parts_are_refused_by_name"),
    Case("planner", "pinned plan passed as sharders", lambda: EmbeddingShardingPlanner(Topology(2)).plan({}, {}),
         TypeError, r"sharders must be a list of module sharders or None, got dict; a pinned plan now goes by keyword",
         _PLAN + "test_planner_api.py::test_pinned_plan_goes_by_keyword"),
    Case("planner", "tables too big for every rank", None, PlannerError, "largest free capacity",
         _PLAN + "test_planner.py::test_infeasible_names_every_table_and_capacity"),
    # --- kernels and strategy -----------------------------------------------------------------------
    Case("kernels", "unknown kernel backend name", None, ValueError, r"unknown kernel 'cuda'; available: auto, fbgemm, torch",
         "tests/kernels/test_kernels.py::test_kernel_errors_list_choices"),
    Case("kernels", "fbgemm on CPU asked for adam", None, ValueError, r"fbgemm on cpu trains only",
         "tests/kernels/test_kernels.py::test_kernel_errors_list_choices"),
    Case("strategy", "unknown checkpoint_format", lambda: _strategy(checkpoint_format="zip"),
         ValueError, r"checkpoint_format must be 'sharded' or 'full', got 'zip'"),
    Case("strategy", "unknown kernel", lambda: _strategy(kernel="cuda"),
         ValueError, r"unknown kernel 'cuda'; available: auto, fbgemm, torch",
         "tests/lightning/test_strategy_errors.py::test_bad_settings_fail_with_choices"),
    Case("strategy", "unknown embedding_optimizer", lambda: _strategy(embedding_optimizer="lamb"),
         ValueError, r"unknown embedding optimizer 'lamb'; available:",
         "tests/lightning/test_strategy_errors.py::test_bad_settings_fail_with_choices"),
    Case("strategy", "negative embedding_lr", lambda: _strategy(embedding_lr=-1.0),
         ValueError, r"embedding_lr.*-1"),
    Case("strategy", "planner_batch_size 0", lambda: _strategy(planner_batch_size=0),
         ValueError, r"planner_batch_size.*0"),
    Case("strategy", "planner_reserve 1.5", lambda: _strategy(planner_reserve=1.5),
         ValueError, r"ShardRecStrategy: planner_reserve is the fraction .* got 1\.5"),
    Case("strategy", "clip_gradients by norm from a hook the strategy was not told of", None, ValueError,
         r"clip_gradients\(gradient_clip_algorithm='norm'\) was called in a fit whose table updates run inside backward",
         "tests/lightning/test_strategy_habits.py::test_a_norm_clip_the_strategy_was_not_told_of_is_refused_by_name"),
    Case("optim", "DeferredTableUpdates over fbgemm kernels", None, ValueError, r"DeferredTableUpdates needs torch kernels",
         "tests/optim/test_deferred_table_updates.py::test_fbgemm_kernels_are_refused_by_name"),
    Case("strategy", "optimizer with no fused form (SGD momentum)", None, ValueError, "has no fused row-sparse form",
         "tests/lightning/test_strategy_errors.py::test_derived_optimizers"),
    # --- data -----------------------------------------------------------------------------------------
    Case("Criteo TSV", "wrong column count", lambda: _read_criteo([_line(), _line(cats=["1"] * 25)]),
         ValueError, r"criteo file .*day_0: line 2: expected 40 tab-separated columns .*got 39",
         _READER + "test_bad_line_errors_name_file_and_line"),
    Case("Criteo TSV", "non-hex categorical", lambda: _read_criteo([_line(cats=["xyz"] + ["1"] * 25)]),
         ValueError, r"day_0: line 1: categorical column cat_0 must be hex of at most 16 digits or blank, got b'xyz'",
         _READER + "test_bad_line_errors_name_file_and_line"),
    Case("Criteo TSV", "non-integer dense value", lambda: _read_criteo([_line(dense=["1.5"] + ["1"] * 12)]),
         ValueError, r"day_0: line 1: dense column int_0 must be a 64-bit integer or blank, got b'1.5'",
         _READER + "test_bad_line_errors_name_file_and_line"),
    Case("Criteo TSV", "label not 0/1", lambda: _read_criteo([_line(label="2")]),
         ValueError, r"day_0: line 1: label must be 0 or 1, got b'2'", _READER + "test_bad_line_errors_name_file_and_line"),
    Case("Criteo TSV", "dense value beyond 64 bits", lambda: _read_criteo([_line(dense=["9" * 20] + ["1"] * 12)]),
         ValueError, r"day_0: line 1: dense column int_0 must be a 64-bit integer or blank, got b'9{20}'"),
    Case("Criteo TSV", "truncated gzip", None, ValueError, "compressed data is truncated or corrupt",
         _READER + "test_truncated_gzip_errors_or_is_skipped"),
    Case("Criteo TSV", "empty .gz file", _read_empty_gz,
         ValueError, r"criteo file .*day_1.gz: line 1: compressed data is truncated or corrupt \(an empty .gz file"),
    Case("Criteo TSV", "unknown on_bad_line", None, ValueError, "on_bad_line must be one of error, skip",
         _READER + "test_reader_argument_errors"),
    Case("Criteo TSV", "wrong number of table sizes", None, ValueError, "need 1 or 26 table sizes",
         _READER + "test_reader_argument_errors"),
    Case("Criteo binary", "no meta.json", lambda: _open_corrupt_binary(lambda p: (p / "meta.json").unlink()),
         ValueError, r"criteo processed_dir '.*p' has no meta.json; run preprocess_criteo first",
         "tests/data/test_criteo_binary.py::test_splits_and_errors"),
    Case("Criteo binary", "corrupt meta.json", lambda: _open_corrupt_binary(lambda p: (p / "meta.json").write_text("{")),
         ValueError, r"criteo .*meta.json is not a preprocess_criteo meta.json \(JSONDecodeError"),
    Case("Criteo binary", ".npy shorter than meta.json says", lambda: _open_corrupt_binary(_truncate_npy),
         ValueError, r"criteo .*day_0.sparse.npy holds int32 \(1, 26\), meta.json says int32 \(2, 26\)"),
    Case("Criteo binary", "format version mismatch", None, ValueError, "has format version 99",
         "tests/data/test_criteo_binary.py::test_format_version_mismatch"),
    Case("DataModule", "batch_size 0", None, ValueError, "batch_size must be an int >= 1, got 0",
         "tests/data/test_datamodules.py::test_synthetic_datamodule_errors"),
    Case("DataModule", "Criteo val+test fraction >= 1", None, ValueError, "must be >= 0 and sum to less than 1",
         "tests/data/test_datamodules.py::test_criteo_datamodule_errors"),
    Case("DataModule", "RecBatch dense rows != labels", None, ValueError, "dense has 3 rows but labels has 4",
         "tests/data/test_recbatch.py::test_shape_errors"),
    # --- CLI ------------------------------------------------------------------------------------------
    Case("CLI", "unknown sharding type in constraints",
         lambda: _cli(_STRATEGY, '--trainer.strategy.constraints={"t_f0": {"sharding_types": ["diagonal"]}}'),
         SystemExit, r"exit 2: (?s:.*)constraints(?s:.*)unknown sharding type 'diagonal'; available: table_wise"),
    Case("CLI", "unknown kernel", lambda: _cli(_STRATEGY, "--trainer.strategy.kernel=cuda"),
         ValueError, r"unknown kernel 'cuda'; available: auto, fbgemm, torch"),
    Case("CLI", "plan CLI with a bad tables file", None, SystemExit, "error",
         _PLAN + "test_plan_io.py::test_cli_reports_errors"),
]


def _params() -> list[object]:
    """The cases that run here; known gaps as strict xfails (they start failing once fixed)."""
    out = []
    for c in CASES:
        if c.trigger is None:
            continue
        marks = [pytest.mark.xfail(strict=True, reason=c.gap)] if c.gap else []
        out.append(pytest.param(c, id=f"{c.area}: {c.wrong}", marks=marks))
    return out


@pytest.mark.parametrize("case", _params())
def test_bad_input_raises_named_error(case: Case) -> None:
    """The trigger raises exactly ``case.error`` whose message matches ``case.match``."""
    assert case.trigger is not None
    with pytest.raises(case.error, match=case.match) as info:
        case.trigger()
    assert type(info.value) is case.error or issubclass(type(info.value), case.error)


def test_every_case_runs_here_or_names_its_test() -> None:
    """A case too costly to run here must point at the test that covers it, and that test must exist."""
    for c in CASES:
        assert c.trigger is not None or c.covered_by, f"{c.area}: {c.wrong}: no trigger and no covered_by"
        if not c.covered_by:
            continue
        path, _, name = c.covered_by.partition("::")
        source = (ROOT / path).read_text()
        assert re.search(rf"^def {re.escape(name)}\(", source, re.M), f"{c.covered_by} does not exist"


def render_table(cases: list[Case]) -> str:
    """The markdown table of ``cases`` (what the module docstring shows)."""
    rows = ["| area | bad input | raises | also covered by |", "| --- | --- | --- | --- |"]
    for c in cases:
        where = "**gap** (xfail)" if c.gap else c.covered_by
        rows.append(f"| {c.area} | {c.wrong} | {c.error.__name__} | {where} |")
    return "\n".join(rows)


def test_table_in_docstring_matches_cases() -> None:
    """The human-readable table at the top of this file is ``CASES``, row for row."""
    doc = __doc__ or ""
    table = doc.split("<!-- table:start -->\n", 1)[1].split("\n<!-- table:end -->", 1)[0]
    assert table == render_table(CASES), "regenerate the docstring table with render_table(CASES)"
