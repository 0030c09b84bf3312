"""Quantized inference: table size, AUROC/NE change and lookups/s of int8/int4/fp16 vs fp32.

    python benchmarks/quant_bench.py [--steps 300] [--repeats 5] [--criteo-rows 300000] [--quick]
        [--write-docs docs/benchmarks.md]

Accuracy: a small model (EmbeddingBagCollection of the synthetic default task's 8
tables, 4 x 200,000 + 4 x 20,000 rows, dim 16, + MLP over 13 dense features) is
trained ``--steps`` steps (batch 1024, Adagrad) with a plain ``Trainer`` on the CPU
in this process, then quantized with ``lightning_shardrec.inference.quantize`` and
scored on held-out synthetic batches (the ``test`` stream). NE = BCE / entropy of
the mean label. "max |logit diff|" is against the fp32 model on the same batches.
Size = stored table bytes (rows + fp16 scale/bias) / fp32 table bytes, and the size
of the file ``inference.export`` writes.

Criteo-format accuracy: ``--criteo-rows`` rows of generated Criteo TSV (label, 13
ints, 26 hex categoricals; never downloaded) whose labels follow a hidden logistic
model over 3 dense and 6 categorical features, read through ``CriteoDataModule``
(26 tables of ``--criteo-embeddings`` rows, dim 16, last 10% of rows held out),
trained ``--steps`` steps with the same model/optimizer/``Trainer``, quantized and
scored the same way.

Throughput: the kernel benchmark's tables (same 8 tables, dim 64, random init) and
batches (1024 x 8 features, ~8 power-law ids per bag), forward only under
``torch.inference_mode``; fp32 = ``EmbeddingBagCollection`` (``nn.EmbeddingBag``
path), quantized = ``QuantEmbeddingBagCollection`` on fbgemm's integer TBE and on the
torch fallback. Median over repeats (each repeat times every case once, shuffled),
1 intra-op thread, ``validate_ids`` on everywhere.

``--write-docs`` replaces only the ``## Quantized inference`` section.
"""

from __future__ import annotations

import argparse
import datetime
import random
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
import lightning as L
import numpy as np
import torch
import torch.nn.functional as F
from harness import replace_section  # noqa: E402
from torchmetrics.classification import BinaryAUROC

from lightning_shardrec import EmbeddingBagCollection, EmbeddingBagConfig, SyntheticRecDataModule, _fbgemm
from lightning_shardrec.data.criteo import NUM_DENSE, NUM_SPARSE
from lightning_shardrec.data.datamodule import CriteoDataModule
from lightning_shardrec.data.synthetic import SyntheticRecGenerator, SyntheticSpec, benchmark_tables, to_features
from lightning_shardrec.inference import QuantEmbeddingBagCollection
from lightning_shardrec.inference.export import export

SECTION = "## Quantized inference"
DTYPES = ["int8", "int4", "fp16"]


class BenchRec(L.LightningModule):
    """EBC + 2-layer MLP over ``[dense | pooled]``."""

    def __init__(self, tables: list[EmbeddingBagConfig], num_dense: int = 13, lr: float = 0.05) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(tables)
        width = num_dense + sum(t.embedding_dim for t in tables)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
        self.lr = lr

    def forward(self, batch: Any) -> torch.Tensor:
        return self.mlp(torch.cat([batch.dense, self.ebc(batch.sparse).values()], 1)).squeeze(1)

    def training_step(self, batch: Any, i: int) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(self(batch), batch.labels)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adagrad(self.parameters(), lr=self.lr)


def evaluate(model: torch.nn.Module, batches: list[Any]) -> tuple[float, float, torch.Tensor]:
    with torch.inference_mode():
        logits = torch.cat([model(b) for b in batches])
    labels = torch.cat([b.labels for b in batches])
    auroc = float(BinaryAUROC()(logits.sigmoid(), labels.long()))
    p = labels.mean().clamp(1e-7, 1 - 1e-7)
    entropy = -(p * p.log() + (1 - p) * (1 - p).log())
    ne = float(F.binary_cross_entropy_with_logits(logits, labels) / entropy)
    return auroc, ne, logits


def trainer(steps: int) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False)


def quantized_rows(model: BenchRec, tables: list[EmbeddingBagConfig], batches: list[Any]) -> list[dict[str, Any]]:
    """fp32 row, then one row per dtype (int8 also with the MLP dynamically quantized)."""
    model.eval()
    base_auroc, base_ne, base_logits = evaluate(model, batches)
    fp32_bytes = sum(t.num_embeddings * t.embedding_dim * 4 for t in tables)
    rows = [{"case": "fp32", "auroc": base_auroc, "ne": base_ne, "diff": 0.0, "ratio": 1.0, "file": None}]
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in DTYPES:
            for dense in (False, True) if dtype == "int8" else (False,):
                out = Path(tmp) / f"{dtype}-{dense}.pt"
                q = export(None, model, dtype, out, dense=dense)
                auroc, ne, logits = evaluate(q, batches)
                qebc = q.get_submodule("ebc")
                assert isinstance(qebc, QuantEmbeddingBagCollection)
                rows.append({
                    "case": dtype + (" + dense int8" if dense else ""), "auroc": auroc, "ne": ne,
                    "diff": float((logits - base_logits).abs().max()), "ratio": qebc.nbytes() / fp32_bytes,
                    "file": out.stat().st_size,
                })
    return rows


def accuracy(steps: int, test_batches: int, batch_size: int, shrink: int) -> dict[str, Any]:
    torch.manual_seed(0)
    tables = [
        EmbeddingBagConfig(num_embeddings=t.num_embeddings // shrink, embedding_dim=16, name=t.name,
                           feature_names=t.feature_names)
        for t in benchmark_tables()
    ]
    dm = SyntheticRecDataModule(
        tables=[{"name": t.feature_names[0], "num_embeddings": t.num_embeddings} for t in tables],
        batch_size=batch_size, num_batches=steps, val_batches=0, test_batches=test_batches,
    )
    model = BenchRec(tables)
    t0 = time.perf_counter()
    trainer(steps).fit(model, dm)
    train_s = time.perf_counter() - t0
    dm.setup("test")
    batches = list(dm.test_dataloader())
    rows = quantized_rows(model, tables, batches)
    return {"rows": rows, "fp32_bytes": sum(t.num_embeddings * t.embedding_dim * 4 for t in tables),
            "train_s": train_s, "n_test": len(batches) * batch_size, "steps": steps, "batch_size": batch_size,
            "tables": tables}


# Hidden logistic model of the generated Criteo-format data.
CRITEO_BIAS = -1.2
CRITEO_DENSE_W = {0: 0.5, 1: -0.4, 2: 0.3}  # on centred log1p(int_j)
CRITEO_CAT_SCALE = {0: 1.0, 1: 0.8, 2: 0.8, 3: 0.6, 4: 0.6, 5: 0.5}  # std of per-value effects of cat_j


def write_criteo_tsv(path: Path, rows: int, vocab: int, seed: int = 0) -> float:
    """``rows`` Criteo-format lines (label, 13 ints, 26 hex categoricals) in ``path``; returns the CTR.

    Ints are log-normal counts (20% blank). Each categorical draws a value from its own
    vocabulary of ``vocab`` random 32-bit hex strings with Zipf(1.3) popularity (5% blank).
    Labels are Bernoulli(sigmoid(CRITEO_BIAS + dense terms + per-value effects)).
    """
    rng = np.random.default_rng(seed)
    counts = np.floor(rng.lognormal(1.5, 1.5, size=(rows, NUM_DENSE))).astype(np.int64)
    dense_blank = rng.random((rows, NUM_DENSE)) < 0.2
    ranks = (rng.zipf(1.3, size=(rows, NUM_SPARSE)) - 1) % vocab
    cat_blank = rng.random((rows, NUM_SPARSE)) < 0.05
    logit = np.full(rows, CRITEO_BIAS)
    for j, w in CRITEO_DENSE_W.items():
        x = np.where(dense_blank[:, j], 0.0, np.log1p(counts[:, j]))
        logit += w * (x - x.mean())
    for j, scale in CRITEO_CAT_SCALE.items():
        effect = rng.normal(0.0, scale, size=vocab)
        logit += np.where(cat_blank[:, j], 0.0, effect[ranks[:, j]])
    labels = (rng.random(rows) < 1 / (1 + np.exp(-logit))).astype(np.int64)
    cols = [labels.astype(str)]
    cols += [np.where(dense_blank[:, j], "", counts[:, j].astype(str)) for j in range(NUM_DENSE)]
    for j in range(NUM_SPARSE):
        hexes = np.array([f"{v:08x}" for v in rng.integers(0, 2**32, size=vocab, dtype=np.uint64)])
        cols.append(np.where(cat_blank[:, j], "", hexes[ranks[:, j]]))
    with path.open("w") as f:
        f.writelines("\t".join(r) + "\n" for r in zip(*(c.tolist() for c in cols), strict=True))
    return float(labels.mean())


def criteo_accuracy(rows: int, vocab: int, num_embeddings: int, steps: int, batch_size: int) -> dict[str, Any]:
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        ctr = write_criteo_tsv(Path(tmp) / "train.txt", rows, vocab)
        gen_s = time.perf_counter() - t0
        dm = CriteoDataModule(tmp, Path(tmp) / "processed", num_embeddings=num_embeddings,
                              batch_size=batch_size, val_fraction=0.0, test_fraction=0.1)
        tables = dm.embedding_tables(16)
        model = BenchRec(tables)
        t0 = time.perf_counter()
        trainer(steps).fit(model, dm)
        train_s = time.perf_counter() - t0
        dm.setup("test")
        batches = list(dm.test_dataloader())
        result = quantized_rows(model, tables, batches)
        n_test = sum(len(b.labels) for b in batches)
    return {"rows": result, "fp32_bytes": sum(t.num_embeddings * t.embedding_dim * 4 for t in tables),
            "train_s": train_s, "gen_s": gen_s, "n_test": n_test, "n_rows": rows, "vocab": vocab, "ctr": ctr,
            "num_embeddings": num_embeddings, "steps": steps, "batch_size": batch_size}


def throughput(batch_size: int, num_batches: int, repeats: int, shrink: int) -> dict[str, Any]:
    torch.manual_seed(0)
    tables = [
        EmbeddingBagConfig(num_embeddings=t.num_embeddings // shrink, embedding_dim=64, name=t.name,
                           feature_names=t.feature_names)
        for t in benchmark_tables()
    ]
    spec = SyntheticSpec(features=to_features([{"name": t.feature_names[0], "num_embeddings": t.num_embeddings}
                                               for t in tables]), num_dense=13)
    gen = SyntheticRecGenerator(spec)
    kjts = [gen.global_batch(i, batch_size, stream=7).sparse for i in range(num_batches)]
    n_ids = sum(k.values().numel() for k in kjts)
    ebc = EmbeddingBagCollection(tables).eval()
    cases: dict[str, torch.nn.Module] = {"fp32 EmbeddingBagCollection (torch)": ebc}
    backends = ["fbgemm", "torch"] if _fbgemm.fbgemm_inference_available() else ["torch"]
    for dtype in DTYPES:
        for backend in backends:
            cases[f"{dtype} {backend}"] = QuantEmbeddingBagCollection.from_float(ebc, dtype, backend=backend)
    seconds: dict[str, list[float]] = {name: [] for name in cases}
    with torch.inference_mode():
        for m in cases.values():  # warm-up (builds the TBEs)
            m(kjts[0])
        for _ in range(repeats):
            order = list(cases)
            random.shuffle(order)
            for name in order:
                t0 = time.perf_counter()
                for k in kjts:
                    cases[name](k)
                seconds[name].append(time.perf_counter() - t0)
    return {"seconds": seconds, "n_ids": n_ids, "batch_size": batch_size, "num_batches": num_batches,
            "repeats": repeats, "rows": [t.num_embeddings for t in tables]}


def machine() -> str:
    fbgemm = "fbgemm_gpu " + ("loaded" if _fbgemm.fbgemm_inference_available() else "absent")
    return f"{harness.machine(isa=False)}, {fbgemm}, 1 thread"


def accuracy_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| tables | size vs fp32 | artifact file | AUROC | change | NE | change | max abs logit diff |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    base = rows[0]
    for r in rows:
        file = "-" if r["file"] is None else f"{r['file'] / 2**20:.1f} MiB"
        lines.append(
            f"| {r['case']} | {r['ratio']:.3f} | {file} | {r['auroc']:.4f} | {r['auroc'] - base['auroc']:+.5f} "
            f"| {r['ne']:.4f} | {r['ne'] - base['ne']:+.5f} | {r['diff']:.2e} |"
        )
    return lines


def report(acc: dict[str, Any], crit: dict[str, Any] | None, thr: dict[str, Any], cmd: str) -> str:
    tables = acc["tables"]
    lines = [
        SECTION, "",
        f"Command: `{cmd}`  ",
        f"Machine: {machine()}. Date: {datetime.date.today().isoformat()}.  ",
        f"Accuracy: {len(tables)} tables ({', '.join(str(t.num_embeddings) for t in tables)} rows, dim 16, "
        f"fp32 {acc['fp32_bytes'] / 2**20:.1f} MiB) + MLP, trained {acc['steps']} steps x batch "
        f"{acc['batch_size']} (Adagrad 0.05, plain `Trainer`, CPU, {acc['train_s']:.0f} s), scored on "
        f"{acc['n_test']:,} held-out synthetic rows. Row-wise quantization, fp16 scale/bias per row.",
        "",
        *accuracy_table(acc["rows"]),
    ]
    if crit is not None:
        lines += [
            "",
            f"Criteo-format: {crit['n_rows']:,} generated rows (label, 13 ints, 26 hex categoricals, "
            f"{crit['vocab']:,} distinct values per categorical, CTR {crit['ctr']:.3f}; labels from a hidden "
            f"logistic model over 3 ints and 6 categoricals, {crit['gen_s']:.0f} s to write) read with "
            f"`CriteoDataModule`: 26 tables x {crit['num_embeddings']:,} rows, dim 16 "
            f"(fp32 {crit['fp32_bytes'] / 2**20:.1f} MiB) + MLP, trained {crit['steps']} steps x batch "
            f"{crit['batch_size']} (same optimizer and `Trainer`, {crit['train_s']:.0f} s), scored on the "
            f"{crit['n_test']:,} held-out rows (last 10%).",
            "",
            *accuracy_table(crit["rows"]),
        ]
    sec, n = thr["seconds"], thr["n_ids"]
    base_s = statistics.median(sec["fp32 EmbeddingBagCollection (torch)"])
    lines += [
        "",
        f"Lookups/s: 8 tables ({', '.join(str(x) for x in thr['rows'])} rows, dim 64), {thr['num_batches']} "
        f"batches of {thr['batch_size']} ({n:,} ids), forward only, median of {thr['repeats']} repeats "
        "(spread = min..max).",
        "",
        "| case | M ids/s (median) | spread | vs fp32 |",
        "|---|---:|---:|---:|",
    ]
    for name, s in sec.items():
        med = statistics.median(s)
        lines.append(f"| {name} | {n / med / 1e6:.2f} | {n / max(s) / 1e6:.2f}..{n / min(s) / 1e6:.2f} "
                     f"| {base_s / med:.2f}x |")
    lines.append("")
    return "\n".join(lines)


def write_section(path: Path, text: str) -> None:
    """Replace (or append) this script's section of ``docs/benchmarks.md``; keep a ``Reading:``."""
    replace_section(path, SECTION, text)
def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--test-batches", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--batches", type=int, default=16, help="batches per timed pass")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--criteo-rows", type=int, default=300_000, help="generated Criteo-format rows (0: skip)")
    p.add_argument("--criteo-vocab", type=int, default=50_000, help="distinct values per categorical")
    p.add_argument("--criteo-embeddings", type=int, default=20_000, help="rows of each of the 26 tables")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: tables 1/100, 5 steps, 2 batches of 128; Criteo 3,000 rows, tables of 1,000")
    p.add_argument("--write-docs", type=Path, default=None)
    a = p.parse_args(argv)
    shrink = 1
    if a.quick:
        a.steps, a.test_batches, a.batch_size, a.batches, a.repeats, shrink = 5, 2, 128, 2, 1, 100
        a.criteo_rows, a.criteo_vocab, a.criteo_embeddings = min(a.criteo_rows, 3_000), 1_000, 1_000
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    acc = accuracy(a.steps, a.test_batches, a.batch_size, shrink)
    crit = None
    if a.criteo_rows > 0:
        crit = criteo_accuracy(a.criteo_rows, a.criteo_vocab, a.criteo_embeddings, a.steps, a.batch_size)
    thr = throughput(a.batch_size, a.batches, a.repeats, shrink)
    cmd = "python benchmarks/quant_bench.py " + " ".join(sys.argv[1:] if argv is None else argv)
    text = report(acc, crit, thr, cmd.strip())
    print(text)
    if a.write_docs is not None:
        write_section(a.write_docs, text)


if __name__ == "__main__":
    main()
