"""Importing the package patches nothing, and what a fit installs on Lightning's objects is undone (issue 40, item 3).

Import side, each in a fresh interpreter: ``import lightning_shardrec`` registers
``strategy="shardrec"`` and leaves Lightning's checkpoint loader, data fetchers, loop
methods, signal handlers, torch's default dtype and ``sys.meta_path`` (but for our own
finder, which answers only for ``lightning_shardrec.*`` names) as they were; the submodules
a serving or data process imports alone import no Lightning.

Fit side: the look-ahead fetcher (``pipeline=True``), the lagged SIGTERM check and the
SIGTERM handler list are installed on one trainer's objects while it trains and are
Lightning's again once ``fit`` returns.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _models import Rec, data, external_launch, trainer

from lightning_shardrec.testing import run_ranks

ROOT = Path(__file__).resolve().parents[2]

SNAPSHOT = """
import signal, sys, torch
import lightning.fabric.plugins.io.torch_io as torch_io
import lightning.pytorch.core.saving as saving
import lightning.pytorch.loops.fetchers as fetchers
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
from lightning.pytorch.strategies import StrategyRegistry

def snapshot():
    return {
        "pl_load": (saving.pl_load, torch_io.pl_load),
        "fetchers": {n: dict(vars(c)) for n, c in vars(fetchers).items() if isinstance(c, type)},
        "loop": dict(vars(_TrainingEpochLoop)),
        "signals": {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)},
        "dtype": torch.get_default_dtype(),
        "meta_path": list(sys.meta_path),
    }
"""


def _run(code: str) -> dict:
    """``code`` in a fresh interpreter with this checkout first on the path; its last stdout line, as JSON."""
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_importing_the_package_registers_the_strategy_and_changes_nothing_else():
    got = _run(
        SNAPSHOT
        + """
import json
before = snapshot()
assert "shardrec" not in StrategyRegistry
import lightning_shardrec
after = snapshot()
from lightning_shardrec.compat.torchrec.paths import TorchRecPathFinder
added = [f for f in after["meta_path"] if f not in before["meta_path"]]
changed = sorted(k for k in before if k != "meta_path" and before[k] != after[k])
print(json.dumps({
    "changed": changed,
    "added": [type(f).__name__ for f in added],
    "kept": all(f in after["meta_path"] for f in before["meta_path"]),
    "registered": "shardrec" in StrategyRegistry,
    "finder_foreign": TorchRecPathFinder.find_spec("torchrec.distributed.embeddingbag"),
}))
"""
    )
    assert got == {
        "changed": [],
        "added": ["TorchRecPathFinder"],
        "kept": True,
        "registered": True,
        "finder_foreign": None,
    }


def test_a_bare_import_lets_the_trainer_find_the_strategy_and_every_public_name_loads():
    got = _run(
        """
import json, sys
import lightning_shardrec
loaded_at_import = sorted(m for m in sys.modules if m.startswith("lightning_shardrec.models"))
import lightning as L
t = L.Trainer(strategy="shardrec", accelerator="cpu", devices=1, logger=False)
names = {n: type(getattr(lightning_shardrec, n)).__name__ for n in lightning_shardrec.__all__}
print(json.dumps({"strategy": type(t.strategy).__name__, "models": loaded_at_import,
                  "missing": sorted(set(lightning_shardrec.__all__) - set(dir(lightning_shardrec))), "n": len(names)}))
"""
    )
    assert got["strategy"] == "ShardRecStrategy"
    assert got["models"] == []  # loaded on first access, not at import
    assert got["missing"] == [] and got["n"] == 29


@pytest.mark.parametrize("module", ["lightning_shardrec.sparse", "lightning_shardrec.inference"])
def test_serving_and_sparse_imports_import_no_lightning(module):
    got = _run(
        f"""
import json, sys, torch
dtype = torch.get_default_dtype()
import {module}
print(json.dumps({{"lightning": sorted(m for m in sys.modules if m == "lightning" or m.startswith("lightning.")),
                  "dtype": str(torch.get_default_dtype()) == str(dtype)}}))
"""
    )
    assert got == {"lightning": [], "dtype": True}


@pytest.mark.parametrize(
    "imports",
    [
        "import lightning_shardrec.models",
        "import lightning; import lightning_shardrec.sparse",
        "import lightning_shardrec",
        # a Lightning-free submodule first, Lightning later: the first public name used registers
        "import lightning_shardrec.testing; import lightning; from lightning_shardrec import EmbeddingBagCollection",
    ],
)
def test_every_import_that_brings_lightning_registers_the_strategy(imports):
    got = _run(
        f"""
import json
{imports}
from lightning.pytorch.strategies import StrategyRegistry
print(json.dumps("shardrec" in StrategyRegistry))
"""
    )
    assert got is True


def fit_and_inspect(rank: int, world: int) -> dict[str, object]:
    """Fit with the pipeline on 2 ranks; what was installed on Lightning's objects during and after training."""
    import lightning as L

    from lightning_shardrec import ShardRecStrategy
    from lightning_shardrec.lightning.pl_compat import (
        SIGTERM_LOOP_CHECK,
        PrefetchDataFetcher,
        fit_data_fetcher,
        signal_connector,
        sigterm_notifier,
    )
    from lightning_shardrec.lightning.training.pipeline import LookaheadFetcher

    external_launch(rank, world)
    seen: dict[str, object] = {}

    class Inspect(L.Callback):
        def on_train_batch_end(self, trainer, *args) -> None:
            if "fetcher" in seen:
                return
            handler = signal.getsignal(signal.SIGTERM)
            own = sigterm_notifier(signal_connector(trainer))
            seen["fetcher"] = fit_data_fetcher(trainer)
            seen["during"] = {
                "fetcher": type(seen["fetcher"]) is LookaheadFetcher,
                "loop check shadowed": SIGTERM_LOOP_CHECK in vars(trainer.fit_loop.epoch_loop),
                "notifier replaced": own not in handler.signal_handlers,
            }
            seen["handler"], seen["own"] = handler, own

    before = signal.getsignal(signal.SIGTERM)
    strategy = ShardRecStrategy(pipeline=True, kernel="torch")
    t = trainer(strategy=strategy, devices=world, max_steps=3, callbacks=[Inspect()])
    t.fit(Rec(), data(8, 5))
    return {
        **seen["during"],
        "fetcher after": type(seen["fetcher"]) is PrefetchDataFetcher and "original" not in vars(seen["fetcher"]),
        "loop check after": SIGTERM_LOOP_CHECK not in vars(t.fit_loop.epoch_loop),
        "handler list after": seen["own"] in seen["handler"].signal_handlers,
        "signal after": signal.getsignal(signal.SIGTERM) == before,
        "dtype after": torch.get_default_dtype() == torch.float32,
        "clip guard after": "clip_gradients" not in vars(t.precision_plugin),
    }


def test_what_fit_installs_on_lightning_objects_is_undone_when_it_returns():
    for got in run_ranks(fit_and_inspect, 2):
        assert got == {
            "fetcher": True,
            "loop check shadowed": True,
            "notifier replaced": True,
            "fetcher after": True,
            "loop check after": True,
            "handler list after": True,
            "signal after": True,
            "dtype after": True,
            "clip guard after": True,
        }
