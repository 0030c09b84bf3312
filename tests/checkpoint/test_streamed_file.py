"""StreamedFile: a torch.save archive written one tensor at a time reads back as torch.save's would."""

from __future__ import annotations

import pytest
import torch

from lightning_shardrec.checkpoint import save_streamed


def _obj(put):
    torch.manual_seed(0)
    big, small = torch.randn(40, 8), torch.randn(3, 4)
    half = torch.randn(6, dtype=torch.float16)
    return {
        "state_dict": {"table": put(big), "row_state": put(torch.arange(40.0)[5:15]), "dense": small},
        "view_of_dense": small[1],  # shares the dense tensor's storage, as torch.save keeps it
        "fused": {"table": {"step": put(torch.tensor(7.0).reshape(())), "m": put(half)}},
        "meta": [1, "x", None],
    }


@pytest.mark.parametrize("mmap", [False, True])
def test_streamed_file_loads_as_torch_save(tmp_path, mmap):
    save_streamed(tmp_path / "s.ckpt", lambda stream: _obj(stream.put))
    torch.save(_obj(lambda t: t), tmp_path / "t.ckpt")
    got = torch.load(tmp_path / "s.ckpt", weights_only=True, mmap=mmap)
    want = torch.load(tmp_path / "t.ckpt", weights_only=True)
    assert got.pop("meta") == want.pop("meta") == [1, "x", None]
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    dense, view = got["state_dict"]["dense"], got["view_of_dense"]
    assert view.untyped_storage().data_ptr() == dense.untyped_storage().data_ptr()


def test_a_failed_streamed_write_leaves_nothing(tmp_path):
    target = tmp_path / "c.ckpt"
    torch.save({"old": torch.ones(2)}, target)

    def fail_after_one(stream):
        stream.put(torch.ones(10))
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        save_streamed(target, fail_after_one)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.ckpt"]
    assert torch.equal(torch.load(target, weights_only=True)["old"], torch.ones(2))
