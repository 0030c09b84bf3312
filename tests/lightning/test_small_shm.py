"""A run whose all-to-alls outgrow a 64 MiB ``/dev/shm`` (Docker's default) trains, the same weights
as on the process group: a tmpfs of that size mounted for the test in a private mount namespace."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(__file__)
ROOT = os.path.dirname(os.path.dirname(HERE))


def _run(cmd: list[str]) -> str:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("LIGHTNING_SHARDREC_TRANSPORT", None)
    done = subprocess.run(cmd, cwd=HERE, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def _can_mount() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = ["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm"]
    return subprocess.run(probe, capture_output=True).returncode == 0


@pytest.mark.slow
@pytest.mark.skipif(not _can_mount(), reason="needs unshare -rm and tmpfs mounts (user namespaces)")
def test_a_64_mib_dev_shm_trains_as_the_process_group(tmp_path):
    fit = [sys.executable, "_small_shm_fit.py"]
    small = f"mount -t tmpfs -o size=64m tmpfs /dev/shm && exec {' '.join(fit)} shm {tmp_path / 'shm.pt'}"
    out = _run(["unshare", "-rm", "sh", "-c", small])
    _run([*fit, "pg", str(tmp_path / "pg.pt")])
    spilled = int(out.split("SHARDREC_SPILLED ")[1].split()[0])
    assert spilled > 0  # the 8 MiB chunks did not all fit: some went point to point
    got, want = torch.load(tmp_path / "shm.pt"), torch.load(tmp_path / "pg.pt")
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k
