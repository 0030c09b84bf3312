import pytest
import torch

from lightning_shardrec import EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor
from lightning_shardrec.configs import EmbeddingBagConfig


def make():
    return EmbeddingCollection(
        [
            EmbeddingConfig(num_embeddings=10, embedding_dim=4, name="t0", feature_names=["f0", "f1"]),
            EmbeddingConfig(num_embeddings=5, embedding_dim=4, name="t1", feature_names=["f2"]),
        ]
    )


def test_rows_per_id_match_nn_embedding():
    ec = make()
    kjt = KeyedJaggedTensor(["f0", "f1", "f2"], torch.tensor([1, 2, 3, 4, 0]), lengths=torch.tensor([2, 0, 1, 0, 1, 1]))
    out = ec(kjt)
    assert list(out) == ["f0", "f1", "f2"]
    torch.testing.assert_close(out["f0"].values(), ec.embeddings["t0"].weight[[1, 2]])
    torch.testing.assert_close(out["f1"].values(), ec.embeddings["t0"].weight[[3]])
    torch.testing.assert_close(out["f2"].values(), ec.embeddings["t1"].weight[[4, 0]])
    assert out["f2"].lengths().tolist() == [1, 1]
    assert list(ec.state_dict()) == ["embeddings.t0.weight", "embeddings.t1.weight"]


def test_need_indices_and_bad_id():
    ec = EmbeddingCollection(
        [EmbeddingConfig(num_embeddings=5, embedding_dim=4, name="t", feature_names=["f"])], need_indices=True
    )
    kjt = KeyedJaggedTensor(["f"], torch.tensor([4, 1]), lengths=torch.tensor([2]))
    assert ec(kjt)["f"].weights().tolist() == [4, 1]
    with pytest.raises(ValueError, match=r"feature 'f' \(table 't'\): id 5 outside \[0, 5\)"):
        ec(KeyedJaggedTensor(["f"], torch.tensor([5]), lengths=torch.tensor([1])))


def test_rejects_bag_configs():
    with pytest.raises(TypeError, match="takes EmbeddingConfig"):
        EmbeddingCollection([EmbeddingBagConfig(num_embeddings=5, embedding_dim=4, name="t", feature_names=["f"])])


def test_shared_feature_is_named_feature_at_table():
    ec = EmbeddingCollection(
        [
            EmbeddingConfig(num_embeddings=10, embedding_dim=5, name="t1", feature_names=["f1", "f2"]),
            EmbeddingConfig(num_embeddings=10, embedding_dim=5, name="t2", feature_names=["f2"]),
        ],
        need_indices=True,
    )
    kjt = KeyedJaggedTensor(["f1", "f2"], torch.tensor([1, 2, 3]), lengths=torch.tensor([2, 1]))
    out = ec(kjt)
    assert list(out) == ["f1", "f2@t1", "f2@t2"]
    assert ec.embedding_names_by_table() == [["f1", "f2@t1"], ["f2@t2"]]
    torch.testing.assert_close(out["f2@t1"].values(), ec.embeddings["t1"].weight[[3]])
    torch.testing.assert_close(out["f2@t2"].values(), ec.embeddings["t2"].weight[[3]])
    assert out["f2@t2"].weights().tolist() == [3] and out["f2@t2"].lengths().tolist() == [1]
    assert ec.embedding_dim() == 5


def test_embedding_dim_needs_one_dim():
    ec = make()
    assert ec.embedding_dim() == 4
    mixed = EmbeddingCollection(
        [
            EmbeddingConfig(num_embeddings=10, embedding_dim=4, name="t0", feature_names=["f0"]),
            EmbeddingConfig(num_embeddings=5, embedding_dim=6, name="t1", feature_names=["f1"]),
        ]
    )
    with pytest.raises(ValueError, match=r"tables have embedding dims \[4, 6\], so there is no single"):
        mixed.embedding_dim()


def test_meta_device():
    ec = EmbeddingCollection(
        [EmbeddingConfig(num_embeddings=10, embedding_dim=3, name="t1", feature_names=["f1"])], device="meta"
    )
    assert ec.embeddings["t1"].weight.device.type == "meta" and ec.device.type == "meta"
