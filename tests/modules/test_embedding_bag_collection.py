import pytest
import torch
import torch.nn.functional as F

from lightning_shardrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, PoolingType


def tables(pooling=PoolingType.SUM):
    return [
        EmbeddingBagConfig(num_embeddings=10, embedding_dim=4, name="t0", feature_names=["f0", "f1"], pooling=pooling),
        EmbeddingBagConfig(num_embeddings=7, embedding_dim=3, name="t1", feature_names=["f2"], pooling=pooling),
    ]


def batch(weighted=False):
    # f0: [[1, 2], [], [9]]  f1: [[3], [4, 5], []]  f2: [[6], [0], [1, 2, 3]]
    values = torch.tensor([1, 2, 9, 3, 4, 5, 6, 0, 1, 2, 3])
    lengths = torch.tensor([2, 0, 1, 1, 2, 0, 1, 1, 3])
    weights = torch.linspace(0.5, 2.0, values.numel()) if weighted else None
    return KeyedJaggedTensor(["f0", "f1", "f2"], values, weights, lengths)


def reference(ebc, kjt, weighted):
    """Bag by bag with plain tensor ops: the definition of pooling."""
    out = []
    for f, table in [("f0", "t0"), ("f1", "t0"), ("f2", "t1")]:
        jt = kjt[f]
        w = ebc.embedding_bags[table].weight
        rows = []
        ws = jt.to_dense_weights() if weighted else None
        for b, ids in enumerate(jt.to_dense()):
            e = w[ids]
            if weighted:
                e = e * ws[b].unsqueeze(1)
            s = e.sum(0)
            if ebc.embedding_bag_configs()[0].pooling is PoolingType.MEAN:
                s = s / max(len(ids), 1)
            rows.append(s)
        out.append(torch.stack(rows))
    return torch.cat(out, 1)


@pytest.mark.parametrize("pooling", [PoolingType.SUM, PoolingType.MEAN])
@pytest.mark.parametrize("weighted", [False, True])
def test_forward_matches_bag_by_bag(pooling, weighted):
    ebc = EmbeddingBagCollection(tables(pooling), is_weighted=weighted)
    kjt = batch(weighted)
    kt = ebc(kjt)
    assert kt.keys() == ["f0", "f1", "f2"]
    assert kt.length_per_key() == [4, 4, 3]
    torch.testing.assert_close(kt.values(), reference(ebc, kjt, weighted))
    assert torch.equal(kt["f0"][1], torch.zeros(4))  # empty bag pools to zero


def test_matches_nn_embedding_bag_modes():
    ebc = EmbeddingBagCollection(tables(PoolingType.MEAN))
    kjt = batch()
    jt = kjt["f2"]
    expected = F.embedding_bag(jt.values(), ebc.embedding_bags["t1"].weight, jt.offsets()[:-1], mode="mean")
    torch.testing.assert_close(ebc(kjt)["f2"], expected)


def test_key_order_of_input_does_not_matter():
    ebc = EmbeddingBagCollection(tables())
    kjt = batch()
    torch.testing.assert_close(ebc(kjt.permute([2, 0, 1])).values(), ebc(kjt).values())


def test_state_dict_layout_is_torchrec():
    ebc = EmbeddingBagCollection(tables())
    sd = ebc.state_dict()
    assert list(sd) == ["embedding_bags.t0.weight", "embedding_bags.t1.weight"]
    assert sd["embedding_bags.t0.weight"].shape == (10, 4)


def test_default_init_range():
    ebc = EmbeddingBagCollection(
        [EmbeddingBagConfig(num_embeddings=400, embedding_dim=8, name="t", feature_names=["f"])]
    )
    w = ebc.embedding_bags["t"].weight
    bound = (1 / 400) ** 0.5
    assert w.abs().max() <= bound and w.abs().max() > bound * 0.9


def test_plain_optimizer_trains_it():
    ebc = EmbeddingBagCollection(tables())
    opt = torch.optim.SGD(ebc.parameters(), lr=0.1)
    before = ebc.embedding_bags["t0"].weight.detach().clone()
    ebc(batch()).values().sum().backward()
    opt.step()
    after = ebc.embedding_bags["t0"].weight.detach()
    assert not torch.equal(before[1], after[1])  # touched row moved
    assert torch.equal(before[8], after[8])  # untouched row did not


def test_meta_device_allocates_nothing():
    cfg = EmbeddingBagConfig(num_embeddings=10**11, embedding_dim=128, name="huge", feature_names=["f"])
    ebc = EmbeddingBagCollection([cfg], device="meta")  # 51 TB if it were real
    assert ebc.embedding_bags["huge"].weight.device.type == "meta"


def test_bad_id_names_feature_table_and_range():
    ebc = EmbeddingBagCollection(
        [EmbeddingBagConfig(num_embeddings=50_000, embedding_dim=4, name="user_table", feature_names=["user_hist"])]
    )
    kjt = KeyedJaggedTensor(["user_hist"], torch.tensor([3, 50003]), lengths=torch.tensor([1, 1]))
    with pytest.raises(ValueError, match=r"feature 'user_hist' \(table 'user_table'\): id 50003 outside \[0, 50000\)"):
        ebc(kjt)
    neg = KeyedJaggedTensor(["user_hist"], torch.tensor([-1]), lengths=torch.tensor([1]))
    with pytest.raises(ValueError, match=r"id -1 outside \[0, 50000\)"):
        ebc(neg)


def test_bad_id_in_second_feature_is_attributed_to_it():
    ebc = EmbeddingBagCollection(tables())
    kjt = KeyedJaggedTensor(["f0", "f1", "f2"], torch.tensor([1, 7]), lengths=torch.tensor([0, 1, 0, 0, 1, 0]))
    with pytest.raises(ValueError, match=r"feature 'f2' \(table 't1'\): id 7 outside \[0, 7\)"):
        ebc(kjt)


def test_validate_ids_can_be_turned_off():
    ebc = EmbeddingBagCollection(tables(), validate_ids=False)
    assert ebc(batch()).values().shape == (3, 11)


def test_missing_feature_is_named():
    ebc = EmbeddingBagCollection(tables())
    kjt = KeyedJaggedTensor(["f0", "f1"], torch.tensor([1]), lengths=torch.tensor([1, 0]))
    with pytest.raises(KeyError, match=r"lacks features \['f2'\]"):
        ebc(kjt)


def test_weighted_needs_weights():
    ebc = EmbeddingBagCollection(tables(), is_weighted=True)
    with pytest.raises(ValueError, match="is_weighted=True.*without weights"):
        ebc(batch(weighted=False))


def test_duplicate_tables_rejected():
    t = tables()
    with pytest.raises(ValueError, match=r"table names repeat: \['t0'\]"):
        EmbeddingBagCollection([t[0], t[0]])
    with pytest.raises(ValueError, match="at least one"):
        EmbeddingBagCollection([])


def test_shared_feature_is_named_feature_at_table():
    # f0 is read by t0 and t9: one output per table, keyed feature@table (TorchRec's rule)
    t9 = EmbeddingBagConfig(num_embeddings=12, embedding_dim=2, name="t9", feature_names=["f0"])
    ebc = EmbeddingBagCollection([*tables(), t9])
    kjt = batch()
    kt = ebc(kjt)
    assert kt.keys() == ["f0@t0", "f1", "f2", "f0@t9"]
    assert kt.length_per_key() == [4, 4, 3, 2]
    jt = kjt["f0"]
    for table, key in [("t0", "f0@t0"), ("t9", "f0@t9")]:
        want = F.embedding_bag(jt.values(), ebc.embedding_bags[table].weight, jt.offsets()[:-1], mode="sum")
        torch.testing.assert_close(kt[key], want)
    assert ebc.feature_names() == ["f0", "f1", "f2", "f0"]
    assert ebc.embedding_names() == ["f0@t0", "f1", "f2", "f0@t9"]
    with pytest.raises(ValueError, match=r"feature 'f0@t8' \(table 't8'\): id 11 outside \[0, 10\)"):
        EmbeddingBagCollection([t9, EmbeddingBagConfig(10, 2, "t8", feature_names=["f0"])])(
            KeyedJaggedTensor(["f0"], torch.tensor([11]), lengths=torch.tensor([1]))
        )


def test_shared_feature_trains_both_tables():
    t9 = EmbeddingBagConfig(num_embeddings=10, embedding_dim=4, name="t9", feature_names=["f0"])
    ebc = EmbeddingBagCollection([tables()[0], t9])
    ebc(KeyedJaggedTensor(["f0", "f1"], torch.tensor([3, 5]), lengths=torch.tensor([1, 1]))).values().sum().backward()
    for table in ("t0", "t9"):
        grad = ebc.embedding_bags[table].weight.grad
        assert grad is not None and grad[3].abs().sum() > 0


def test_meta_forward_returns_meta_output():
    ebc = EmbeddingBagCollection(tables(), is_weighted=True, device=torch.device("meta"))
    kjt = batch(weighted=True)
    meta = KeyedJaggedTensor(kjt.keys(), kjt.values().to("meta"), kjt.weights().to("meta"), kjt.lengths().to("meta"))
    for features in (kjt, meta):
        kt = ebc(features)
        assert kt.values().device.type == "meta" and kt.values().shape == (3, 11)
        assert kt.keys() == ["f0", "f1", "f2"] and kt.offset_per_key() == [0, 4, 8, 11]
    with torch.device("meta"):
        ebc = EmbeddingBagCollection(tables())
    assert ebc.device.type == "meta" and ebc.embedding_bags["t0"].weight.device.type == "meta"


def test_init_fn_initialises_the_weight():
    cfg = EmbeddingBagConfig(5, 3, "t", feature_names=["f"], init_fn=lambda w: torch.nn.init.constant_(w, 0.25))
    ebc = EmbeddingBagCollection([cfg])
    assert torch.equal(ebc.embedding_bags["t"].weight, torch.full((5, 3), 0.25))
    ebc.embedding_bags["t"].weight.data.zero_()
    ebc.reset_parameters()
    assert torch.equal(ebc.embedding_bags["t"].weight, torch.full((5, 3), 0.25))
