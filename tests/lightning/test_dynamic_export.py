"""A dynamic table trained sharded, saved as a sharded checkpoint, exported and served on raw ids."""

from __future__ import annotations

import lightning as L
import torch
from test_dynamic_monitor import DynRec, _data_for

from lightning_shardrec.checkpoint import convert_to_full
from lightning_shardrec.inference import load
from lightning_shardrec.inference.export import export
from lightning_shardrec.modules.dynamic.stats import saved_figures
from lightning_shardrec.testing import run_ranks


def _fit_and_save(rank: int, world: int, path: str) -> dict[str, dict[str, int]]:
    from _models import external_launch

    from lightning_shardrec import ShardRecStrategy

    external_launch(rank, world)
    trainer = L.Trainer(
        accelerator="cpu", devices=world, logger=False, strategy=ShardRecStrategy(heartbeat_timeout=None),
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, max_steps=6,
    )
    trainer.fit(DynRec(), _data_for(8))
    trainer.save_checkpoint(path)
    return trainer.strategy.sharded["ebc"].dynamic_stats()


def test_export_of_a_sharded_dynamic_checkpoint_serves_raw_ids(tmp_path) -> None:
    ckpt = tmp_path / "ckpt"
    stats = run_ranks(_fit_and_save, 2, str(ckpt))[0]
    assert stats["t_user"]["evictions"] > 0  # the id map changed while training
    export(ckpt, "test_dynamic_monitor:DynRec", "int8", tmp_path / "model.pt", factory_kwargs={})
    served = load(tmp_path / "model.pt")
    convert_to_full(ckpt, tmp_path / "full.ckpt")
    ref = DynRec()
    ref.load_state_dict(torch.load(tmp_path / "full.ckpt", weights_only=True)["state_dict"])
    ref.eval()
    assert saved_figures(ref.ebc.dynamic_stats()) == saved_figures(stats)  # the window is not saved
    data = _data_for(16)
    data.setup("fit")
    batches = list(data.train_dataloader())
    assert batches
    with torch.no_grad():
        for batch in batches:  # int8 rows: within quantization error of the float model in eval
            torch.testing.assert_close(served(batch), ref(batch), rtol=0.02, atol=0.02)
