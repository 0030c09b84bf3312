"""A plain checkpoint file, memory-mapped for a sharded resume (issue 29): pieces copied, their pages
handed back without losing data, kept state copied out of the file, and which files are mapped at all."""

from __future__ import annotations

from pathlib import Path

import torch

from lightning_shardrec.checkpoint import mapped_file
from lightning_shardrec.checkpoint.mapped_file import load_mapped, mappable

MiB = 2**20


def _rss_file() -> int:
    """Resident bytes of file-backed mappings in this process (``RssFile``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssFile:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssFile in /proc/self/status")


def test_each_piece_is_copied_and_its_pages_handed_back(tmp_path, monkeypatch):
    monkeypatch.setattr(mapped_file, "PIECE_BYTES", 4 * MiB)
    table = torch.randn(2**20, 16)  # 64 MiB
    torch.save({"state_dict": {"t": table}, "step": torch.tensor(3.0)}, tmp_path / "plain.ckpt")
    checkpoint, mapped = load_mapped(tmp_path / "plain.ckpt", weights_only=True)
    source = checkpoint["state_dict"]["t"]
    assert mapped.mapped(source) and mapped.mapped(source[10:20]) and not mapped.mapped(table)
    before = _rss_file()
    rows = torch.empty(2**19, 16)
    mapped.copy(rows, source[2**19 :])  # a rank's half of the rows
    grown = _rss_file() - before
    assert torch.equal(rows, table[2**19 :])
    assert grown < 8 * MiB, f"file pages left resident after copying 32 MiB in 4 MiB pieces: {grown / MiB:.1f} MiB"
    assert torch.equal(source, table)  # handed back, not lost: read again from the file
    cols = torch.empty(2**20, 4)
    mapped.copy(cols, source[:, 4:8])  # a column piece: strided
    assert torch.equal(cols, table[:, 4:8])


def test_state_kept_past_the_load_is_copied_out_of_the_file(tmp_path):
    torch.save({"optimizer_states": [{"state": {0: {"sum": torch.ones(3)}}}], "mine": 1}, tmp_path / "plain.ckpt")
    checkpoint, mapped = load_mapped(tmp_path / "plain.ckpt", weights_only=True)
    mine = torch.zeros(3)
    owned = mapped.owned({"saved": checkpoint["optimizer_states"], "mine": mine, "n": 1})
    kept = owned["saved"][0]["state"][0]["sum"]
    assert torch.equal(kept, torch.ones(3)) and not mapped.mapped(kept)
    assert owned["mine"] is mine and owned["n"] == 1  # what was not in the file is left as it is


def test_only_local_zip_files_are_mapped(tmp_path):
    torch.save({"a": torch.ones(2)}, tmp_path / "zip.ckpt")
    torch.save({"a": torch.ones(2)}, tmp_path / "legacy.ckpt", _use_new_zipfile_serialization=False)
    (tmp_path / "dir.ckpt").mkdir()
    assert mappable(tmp_path / "zip.ckpt") and mappable(str(tmp_path / "zip.ckpt"))
    for path in ["legacy.ckpt", "dir.ckpt", "missing.ckpt"]:
        assert not mappable(tmp_path / path), path
    assert not mappable(f"file://{tmp_path / 'zip.ckpt'}") and not mappable(object())
