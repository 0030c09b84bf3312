"""Dynamic tables' id mappings in checkpoints, one process: chunks by bucket range, global tensors, layout checks."""

from __future__ import annotations

import pytest
import torch

from lightning_shardrec import DynamicConfig, EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingConfig
from lightning_shardrec.checkpoint.dynamic_state import assemble, mapper_chunks, mapper_copies, mapper_pieces
from lightning_shardrec.modules import DynamicIdMapper, bucket_of
from lightning_shardrec.modules.dynamic.layout import BUFFERS, DynamicLayout, layout_problems
from tests.modules._dynamic_reference import stream

CONFIG = DynamicConfig(num_buckets=8, eviction="lfu", min_count=2, candidates_per_bucket=3, ttl_steps=6)
TABLE = EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=16, feature_names=["f"], dynamic=CONFIG)
LAYOUT = DynamicLayout.of(TABLE)
PREFIX = "ebc.dynamic_tables.t."


def parts(ranges: list[tuple[int, int]]) -> list[DynamicIdMapper]:
    return [DynamicIdMapper("t", CONFIG, 16, bucket_range=r) for r in ranges]


def train(mappers: list[DynamicIdMapper], batches: list[list[int]]) -> list[list[int]]:
    """Each mapper maps the ids of its buckets (at its own step); returns every step's global slots."""
    out = []
    for batch in batches:
        ids = torch.tensor(batch)
        got = torch.full_like(ids, -1)
        bucket = bucket_of(ids, LAYOUT.num_buckets)
        for m in mappers:
            mine = (bucket >= m.bucket_lo) & (bucket < m.bucket_hi)
            got[mine] = m.map(ids[mine], True).slots
        out.append(got.tolist())
    return out


def test_global_layout_matches_the_unsharded_state_dict() -> None:
    ebc = EmbeddingBagCollection([TABLE])
    state = {k.split(".")[-1]: tuple(v.shape) for k, v in ebc.state_dict().items() if "dynamic_tables" in k}
    assert state == {b: LAYOUT.size(b) for b in BUFFERS}
    assert (LAYOUT.capacity, LAYOUT.num_buckets, LAYOUT.slots_per_bucket, LAYOUT.cands_per_bucket) == (16, 8, 2, 3)
    assert LAYOUT.chunk("slot_gen", 3, 6) == ((6,), (6,)) and LAYOUT.chunk("cand_ids", 3, 6) == ((9,), (9,))
    assert LAYOUT.chunk("counters", 3, 6) == ((3, 0), (3, 5)) and LAYOUT.chunk("step", 3, 6) == ((), ())


def test_saved_on_two_ranges_resumes_on_three_like_the_whole_table() -> None:
    batches = stream(24, 40, 12, seed=11)
    whole = parts([(0, 8)])
    saved = parts([(0, 4), (4, 8)])
    assert train(saved, batches[:12]) == train(whole, batches[:12])
    full = assemble(LAYOUT, PREFIX, [mapper_chunks(LAYOUT, PREFIX, m) for m in saved])
    for name in BUFFERS:  # the full format is the whole-table mapper's state
        assert torch.equal(full[PREFIX + name], getattr(whole[0], name)), name
    resumed = parts([(0, 3), (3, 6), (6, 8)])
    with torch.no_grad():
        for m in resumed:
            for dest, source in mapper_copies(LAYOUT, PREFIX, m, full):
                dest.copy_(source)
    assert train(resumed, batches[12:]) == train(whole, batches[12:])
    again = assemble(LAYOUT, PREFIX, [mapper_chunks(LAYOUT, PREFIX, m) for m in resumed])
    for name in BUFFERS:
        assert torch.equal(again[PREFIX + name], getattr(whole[0], name)), name
    stats = whole[0].stats()
    assert stats["evictions"] + stats["expirations"] > 0 and stats["dropped_candidates"] + stats["admissions"] > 0
    assert {k: sum(m.stats()[k] for m in resumed) for k in stats} == stats


def test_dcp_pieces_chunk_every_rank_and_keep_step_plain() -> None:
    ranges = [(0, 3, 0), (3, 6, 1), (6, 8, 2)]
    mine = parts([(3, 6)])[0]
    pieces = {p.key[len(PREFIX) :]: p for p in mapper_pieces(LAYOUT, PREFIX, ranges, mine)}
    assert set(pieces) == set(BUFFERS)
    assert pieces["slot_ids"].chunks == [((0,), (6,), 0), ((6,), (6,), 1), ((12,), (4,), 2)]
    assert pieces["cand_step"].offsets == (9,) and pieces["cand_step"].local is mine.cand_step
    assert pieces["counters"].chunks[2] == ((6, 0), (2, 5), 2) and pieces["counters"].size == (8, 5)
    assert pieces["step"].chunks == [] and pieces["step"].local is mine.step
    absent = {p.key: p.local for p in mapper_pieces(LAYOUT, PREFIX, ranges, None)}
    assert set(absent.values()) == {None}
    no_cands = DynamicLayout.of(
        EmbeddingConfig(
            name="u", embedding_dim=2, num_embeddings=8, feature_names=["g"], dynamic=DynamicConfig(num_buckets=4)
        )
    )
    empty = {p.key: p.chunks for p in mapper_pieces(no_cands, "", [(0, 4, 0)], None)}
    assert empty["cand_ids"] == [] and empty["slot_ids"] == [((0,), (8,), 0)]  # empty buffers: plain


def _saved(layout: DynamicLayout) -> dict[str, tuple[int, ...]]:
    return {b: layout.size(b) for b in BUFFERS}


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (
            {"num_embeddings": 32},
            r"dynamic table 't': capacity \(num_embeddings\) changed: the checkpoint has 32, the model 16",
        ),
        ({"num_buckets": 4}, r"dynamic table 't': num_buckets changed: the checkpoint has 4, the model 8"),
        (
            {"cands": 5},
            r"dynamic table 't': candidates per bucket \(candidates_per_bucket; 0 when min_count is 1\) "
            r"changed: the checkpoint has 5, the model 3",
        ),
        (
            {"dim": 8},
            r"dynamic table 't': embedding_dim changed: the checkpoint has 8, the model 4; a dynamic table "
            r"resumes only with the layout it was saved with",
        ),
    ],
)
def test_a_changed_layout_is_named(change: dict, match: str) -> None:
    rows = change.get("num_embeddings", 16)
    buckets = change.get("num_buckets", 8)
    saved = DynamicLayout("t", buckets, rows // buckets, change.get("cands", 3), change.get("dim", 4))
    problems = layout_problems(LAYOUT, _saved(saved), saved.dim, PREFIX)
    assert len(problems) == 1
    with pytest.raises(ValueError, match=match):
        _raise(problems)


def _raise(problems: list[str]) -> None:
    raise ValueError("\n".join(problems))


def test_missing_and_misshapen_buffers_are_listed() -> None:
    saved = _saved(LAYOUT)
    assert layout_problems(LAYOUT, saved, 4) == []
    del saved["slot_gen"]
    saved["step"] = (1,)
    assert layout_problems(LAYOUT, saved, None, PREFIX) == [
        f"'{PREFIX}slot_gen': in the model, missing from the checkpoint",
        f"'{PREFIX}step': checkpoint has shape (1,), model expects ()",
    ]
    with pytest.raises(
        ValueError,
        match=r"dynamic table 't': the checkpoint holds no id mapping for it "
        r"\('ebc.dynamic_tables.t.slot_ids', ...\): it was saved as a static table",
    ):
        _raise(layout_problems(LAYOUT, {}, 4, PREFIX))


def test_unsharded_module_refuses_another_layout_by_name() -> None:
    ebc = EmbeddingBagCollection([TABLE])
    train([ebc.dynamic_tables.mapper("t")], stream(6, 20, 8, seed=1))
    same = EmbeddingBagCollection([TABLE])
    same.load_state_dict(ebc.state_dict())  # exact round trip
    for name, value in same.state_dict().items():
        assert torch.equal(value, ebc.state_dict()[name]), name
    other = EmbeddingBagConfig(
        name="t",
        embedding_dim=4,
        num_embeddings=16,
        feature_names=["f"],
        dynamic=DynamicConfig(num_buckets=4, min_count=2),
    )
    with pytest.raises(
        RuntimeError, match=r"dynamic table 't': num_buckets changed: the checkpoint has 8, the model 4"
    ):
        EmbeddingBagCollection([other]).load_state_dict(ebc.state_dict())
    with pytest.raises(ValueError, match="table 'x' is not dynamic"):
        DynamicLayout.of(EmbeddingBagConfig(name="x", embedding_dim=4, num_embeddings=16, feature_names=["f"]))
