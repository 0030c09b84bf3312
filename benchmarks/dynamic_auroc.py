"""Dynamic table vs ``id % N`` hashing at equal memory, on a stream with drifting ids (issue 20, item 7).

    python benchmarks/dynamic_auroc.py [--steps 300] [--batch 512] [--rows 4096]
        [--plot docs/dynamic_vs_hashing.png] [--markdown]

The stream (synthetic, seeded): two id features (``user``, ``item``), one id each per
sample. Ids are random 63-bit values. Each feature has a *live set* of ``L`` ids that
drifts: every step ``L / lifetime`` new ids are born and as many of the oldest die, so over
the stream about ``L * (1 + steps / lifetime)`` distinct ids appear, many times the table.
A live id is drawn with a fixed heavy-tailed (Pareto) popularity. The label of a sample is
Bernoulli(sigmoid(s_user + s_item + b)) with a hidden per-id effect ``s ~ N(0, 1.5^2)``
(a hash of the id): what a row of an embedding table has to learn.

Models (same everything but the table): an ``EmbeddingBagCollection`` of two tables of
``--rows`` rows x dim 16 and a linear layer over the two pooled rows; Adagrad (lr 0.1), one
pass over the stream, batch ``--batch``.

- ``dynamic``: ``dynamic=DynamicConfig()`` tables (LRU, 16 slots per bucket) fed the raw ids.
- ``hash``: static tables fed ``id % rows``: equal table memory (rows x dim).
- ``hash_bytes``: static tables fed ``id % (1.25 x rows)``: equal *bytes*, counting the
  dynamic table's 32 bytes of mapping per row (id, last step, count, generation: int64)
  against the 128 bytes of a dim-16 fp32 row and its Adagrad state.
- ``oracle``: the hidden logits themselves (the ceiling).

Evaluation is progressive: each batch is scored before the model trains on it, and the
figures are over the recent window (the last quarter of the stream): AUROC and normalized
entropy (log loss / entropy of the window's base rate; lower is better, 1 = no better than
the base rate). The sweep varies ``L / rows`` (live ids per table row).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_shardrec import DynamicConfig, EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from lightning_shardrec.modules import optimizer_reset_hook
from lightning_shardrec.modules.dynamic.hashing import mix64, shr

DIM = 16
LR = 0.1
EFFECT = 1.5
BIAS = -1.0
FEATURES = ("user", "item")
METHODS = ("dynamic", "hash", "hash_bytes", "oracle")
BYTES_RATIO = 1.25  # (2 * 4 * DIM + 32) / (2 * 4 * DIM): weights + Adagrad state vs + mapping


@dataclass(frozen=True)
class Stream:
    live: int  # live ids per feature
    lifetime: int  # steps an id lives
    steps: int
    batch: int
    skew: float = 1.2  # Pareto alpha of the popularity; 0: every live id equally likely
    seed: int = 0

    def ids(self, feature: int) -> tuple[Tensor, Tensor]:
        """``(raw ids [M], popularity [M])`` of every id of ``feature`` in birth order."""
        total = self.live + math.ceil(self.live * self.steps / self.lifetime) + 1
        index = torch.arange(total, dtype=torch.int64) + (feature << 40) + (self.seed << 48)
        raw = mix64(index) & ((1 << 63) - 1)
        g = torch.Generator().manual_seed(self.seed * 31 + feature)
        u = torch.rand(total, generator=g, dtype=torch.float64)
        popularity = u.pow(-1 / self.skew) if self.skew > 0 else torch.ones_like(u)  # Pareto(skew)
        return raw, popularity

    def batches(self) -> list[tuple[list[Tensor], Tensor, Tensor]]:
        """Per step: ``(ids per feature [B], labels [B], hidden logits [B])``."""
        g = torch.Generator().manual_seed(self.seed + 1000)
        per_feature = [self.ids(f) for f in range(len(FEATURES))]
        born = self.live / self.lifetime
        out = []
        for t in range(self.steps):
            lo = int(t * born)
            ids, logit = [], torch.full((self.batch,), BIAS, dtype=torch.float64)
            for raw, pop in per_feature:
                pick = lo + torch.multinomial(pop[lo : lo + self.live], self.batch, replacement=True, generator=g)
                ids.append(raw[pick])
                logit += hidden_effect(raw[pick])
            labels = (torch.rand(self.batch, generator=g, dtype=torch.float64) < torch.sigmoid(logit)).float()
            out.append((ids, labels, logit.float()))
        return out


def hidden_effect(raw: Tensor) -> Tensor:
    """The hidden per-id effect ``~ N(0, EFFECT^2)`` (Box-Muller of two hashes of the id)."""
    a = shr(mix64(raw), 11).double() * 2.0**-53
    b = shr(mix64(raw ^ 0x5BD1E995), 11).double() * 2.0**-53
    return EFFECT * torch.sqrt(-2 * torch.log1p(-a)) * torch.cos(2 * math.pi * b)


class Model(nn.Module):
    def __init__(self, rows: int, dynamic: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        tables = [
            EmbeddingBagConfig(
                name=f, embedding_dim=DIM, num_embeddings=rows, feature_names=[f],
                dynamic=DynamicConfig() if dynamic else None,
            )
            for f in FEATURES
        ]  # fmt: skip
        self.ebc = EmbeddingBagCollection(tables)
        self.top = nn.Linear(DIM * len(FEATURES), 1)

    def forward(self, kjt: KeyedJaggedTensor) -> Tensor:
        return self.top(self.ebc(kjt).values()).squeeze(1)


def run(method: str, stream: list[tuple[list[Tensor], Tensor, Tensor]], rows: int) -> tuple[Tensor, Tensor]:
    """Progressive predictions (logits) and labels of every step of ``stream``."""
    preds, labels = [], []
    if method == "oracle":
        return torch.stack([s[2] for s in stream]), torch.stack([s[1] for s in stream])
    table_rows = {"dynamic": rows, "hash": rows, "hash_bytes": int(rows * BYTES_RATIO)}[method]
    model = Model(table_rows, method == "dynamic")
    opt = torch.optim.Adagrad(model.parameters(), lr=LR)
    model.ebc.register_reset_hook(optimizer_reset_hook(opt))
    for ids, y, _ in stream:
        values = torch.cat(ids) if method == "dynamic" else torch.cat(ids) % table_rows
        kjt = KeyedJaggedTensor(list(FEATURES), values, lengths=torch.ones(values.numel(), dtype=torch.int64))
        model.eval()
        with torch.no_grad():
            preds.append(model(kjt))
        model.train()
        loss = F.binary_cross_entropy_with_logits(model(kjt), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        labels.append(y)
    return torch.stack(preds), torch.stack(labels)


def auroc(logits: Tensor, labels: Tensor) -> float:
    """Exact AUROC (Mann-Whitney U with average ranks for ties)."""
    x, y = logits.reshape(-1).double(), labels.reshape(-1)
    order = torch.argsort(x)
    xs = x[order]
    ranks = torch.empty_like(xs)
    _, inverse, counts = torch.unique_consecutive(xs, return_inverse=True, return_counts=True)
    ends = torch.cumsum(counts, 0).double()
    ranks = ((ends - counts.double() + 1 + ends) / 2)[inverse]
    pos = y[order] > 0.5
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def normalized_entropy(logits: Tensor, labels: Tensor) -> float:
    y = labels.reshape(-1)
    loss = F.binary_cross_entropy_with_logits(logits.reshape(-1).float(), y)
    p = float(y.mean())
    return float(loss) / -(p * math.log(p) + (1 - p) * math.log(1 - p))


def rolling_auroc(preds: Tensor, labels: Tensor, window: int) -> list[float]:
    spans = [slice(max(0, t - window + 1), t + 1) for t in range(len(preds))]
    return [auroc(preds[s], labels[s]) for s in spans]


def plot(
    path: Path, curves: dict[str, list[float]], sweep: dict[float, dict[str, float]], a: argparse.Namespace
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"dynamic": "tab:blue", "hash": "tab:red", "hash_bytes": "tab:orange", "oracle": "k"}
    labels = {
        "dynamic": "dynamic table (raw ids)",
        "hash": "id % N (equal rows)",
        "hash_bytes": f"id % {BYTES_RATIO}N (equal bytes)",
        "oracle": "hidden model (ceiling)",
    }
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for m, c in curves.items():
        left.plot(range(len(c)), c, color=colors[m], label=labels[m], ls="--" if m == "oracle" else "-")
    left.set_xlabel("step")
    left.set_ylabel(f"AUROC (progressive, last {a.window} steps)")
    left.set_title(f"live ids per table row = {a.curve_load:g} (N = {a.rows:,} rows)", fontsize=9)
    left.legend(fontsize=8)
    loads = sorted(sweep)
    for m in METHODS:
        right.plot(loads, [sweep[x][m] for x in loads], marker="o", color=colors[m], label=labels[m],
                   ls="--" if m == "oracle" else "-")  # fmt: skip
    right.set_xscale("log", base=2)
    right.set_xlabel("live ids per table row (L / N)")
    right.set_ylabel("AUROC, last quarter of the stream")
    right.set_title("equal table memory; higher is better", fontsize=9)
    right.legend(fontsize=8)
    fig.suptitle(f"drifting ids: {a.steps} steps x {a.batch}, ids live {a.lifetime} steps", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--rows", type=int, default=4096, help="rows per table (the memory both methods get)")
    p.add_argument("--lifetime", type=int, default=60, help="steps an id lives")
    p.add_argument("--loads", default="0.25,0.5,1,2,4", help="live ids per table row to sweep")
    p.add_argument("--skew", type=float, default=1.2, help="Pareto alpha of id popularity (0: uniform)")
    p.add_argument("--curve-load", type=float, default=0.5, help="the load whose AUROC curve is plotted")
    p.add_argument("--window", type=int, default=20, help="steps per point of the AUROC curve")
    p.add_argument("--plot", type=Path, default=None)
    p.add_argument("--markdown", action="store_true", help="print the table as markdown")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    loads = [float(x) for x in a.loads.split(",")]
    sweep: dict[float, dict[str, float]] = {}
    ne: dict[float, dict[str, float]] = {}
    curves: dict[str, list[float]] = {}
    start = time.perf_counter()
    for load in sorted(set(loads + [a.curve_load])):
        stream = Stream(int(load * a.rows), a.lifetime, a.steps, a.batch, a.skew).batches()
        recent = slice(a.steps - a.steps // 4, a.steps)
        sweep[load], ne[load] = {}, {}
        for m in METHODS:
            preds, labels = run(m, stream, a.rows)
            sweep[load][m] = auroc(preds[recent], labels[recent])
            ne[load][m] = normalized_entropy(preds[recent], labels[recent])
            if load == a.curve_load:
                curves[m] = rolling_auroc(preds, labels, a.window)
        print(f"dynamic_auroc: L/N = {load:g} done ({time.perf_counter() - start:.0f} s)", file=sys.stderr)
    header = "| live ids per row (L/N) | " + " | ".join(f"{m} AUROC / NE" for m in METHODS) + " |"
    lines = [header, "|---:|" + "---:|" * len(METHODS)]
    for load in loads:
        cells = " | ".join(f"{sweep[load][m]:.4f} / {ne[load][m]:.4f}" for m in METHODS)
        lines.append(f"| {load:g} | {cells} |")
    print("\n".join(lines) if a.markdown else "\n".join(lines).replace("|", " "))
    if a.plot is not None:
        plot(a.plot, curves, sweep, a)


if __name__ == "__main__":
    main()
