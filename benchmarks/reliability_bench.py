# ruff: noqa: E501  (the report template reads best as whole markdown lines)
"""Fault injection figures for docs/reliability.md (issue 13).

    python benchmarks/reliability_bench.py [--repeats 3] [--write-docs docs/reliability.md]

Each case is a real 2-rank ``Trainer(strategy="shardrec")`` job started by Lightning's
subprocess launcher (``tests/lightning/_fault_run.py``: 10 steps, checkpoints every 5):

- **dead rank**: rank 1 SIGKILLs itself before step 7. Time to detect = from the kill to
  the moment the job's last process has exited (the survivors' error names rank 1).
- **hung rank**: rank 1 SIGSTOPs itself before step 3; the heartbeat watchdog
  (``heartbeat_timeout``) must find it, since gloo would wait the full collective timeout.
- **resume**: ``fit(ckpt_path="last")`` after the dead-rank run; its final weights must
  equal an uninterrupted run's bit for bit. Resume overhead = the time rank 0 spends in
  the strategy's ``load_checkpoint`` (reading and placing the sharded checkpoint), next
  to a checkpoint save and a training step of the same job.
- **checkpoint at size**: 2 ranks, ``DistributedModelParallel`` over two 200,000 x 64
  fp32 tables (row-wise, fused Adagrad: 205 MB with state); atomic sharded save and
  validated load, each timed against a training step (batch 2048 per rank, 10 ids per bag).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from harness import Stat, replace_section  # noqa: E402

from lightning_shardrec.testing import run_ranks  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "lightning" / "_fault_run.py"
SECTION = "## Measured"


def job(out: Path, *args: str) -> tuple[int, str, float]:
    """Run one job; (exit code, output, wall-clock time at which it had fully exited)."""
    out.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(out), *args], capture_output=True, text=True, timeout=600, cwd=SCRIPT.parent
    )
    return proc.returncode, proc.stdout + proc.stderr, time.time()


def fault_at(out: Path, text: str) -> float:
    marker = out / "fault_at"
    if not marker.exists():
        raise RuntimeError(f"the job in {out} ended before its fault was injected:\n{text[-3000:]}")
    return float(marker.read_text())


def timings(out: Path) -> dict[str, list[float]]:
    return json.loads((out / "times.json").read_text())


def checkpoint_at_size(rank: int, world: int, path: str, repeats: int) -> dict[str, list[float]]:
    """Rank ``rank``'s seconds per training step, sharded save and load (one process of ``world``)."""
    from lightning_shardrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
    from lightning_shardrec.checkpoint import load_sharded, save_sharded
    from lightning_shardrec.distributed import DistributedModelParallel
    from lightning_shardrec.planner import ParameterSharding, ShardMetadata

    rows, dim, batch, bag = 200_000, 64, 2048, 10
    tables = [EmbeddingBagConfig(num_embeddings=rows, embedding_dim=dim, name=f"t{i}", feature_names=[f"f{i}"]) for i in range(2)]
    half = rows // world
    blocks = [ShardMetadata((r * half, 0), (half if r < world - 1 else rows - r * half, dim), r) for r in range(world)]
    plan = {t.name: ParameterSharding("row_wise", "fused", list(range(world)), blocks) for t in tables}
    dmp = DistributedModelParallel(EmbeddingBagCollection(tables, device="meta"), plan=plan, embedding_optimizer="adagrad")
    gen = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, rows, (2 * batch * bag,), generator=gen)
    kjt = KeyedJaggedTensor(["f0", "f1"], ids, lengths=torch.full((2 * batch,), bag))
    out: dict[str, list[float]] = {"step": [], "save": [], "load": []}
    for i in range(repeats + 1):
        started = time.perf_counter()
        dmp(kjt).values().sum().backward()
        if i:
            out["step"].append(time.perf_counter() - started)
    for _ in range(repeats):
        started = time.perf_counter()
        save_sharded(path, dmp.sharded, {}, {"step": 1}, rank)
        out["save"].append(time.perf_counter() - started)
        started = time.perf_counter()
        load_sharded(path, dmp.sharded, {}, rank)
        out["load"].append(time.perf_counter() - started)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hang-timeout", type=float, default=10.0)
    parser.add_argument("--write-docs", type=Path)
    args = parser.parse_args()
    dead, hung, load, save, step = [], [], [], [], []
    named = {"dead": 0, "hung": 0}
    exact = 0
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            base = Path(tmp) / str(i)
            code, text, ended = job(base / "dead", "--fault", "kill", "--rank", "1", "--step", "7")
            named["dead"] += code != 0 and "lightning_shardrec: rank 1 died" in text
            dead.append(ended - fault_at(base / "dead", text))
            code, text, ended = job(
                base / "hung", "--fault", "stop", "--step", "3", "--heartbeat-timeout", str(args.hang_timeout)
            )
            named["hung"] += code != 0 and "lightning_shardrec: rank 1 stopped (no heartbeat" in text
            hung.append(ended - fault_at(base / "hung", text))
            for out, extra in ((base / "dead", ["--resume"]), (base / "straight", [])):
                code, text, _ = job(out, *extra)
                if code != 0:
                    raise RuntimeError(f"{out.name} {' '.join(extra)} failed:\n{text[-4000:]}")
            got = torch.load(base / "dead" / "final.pt", weights_only=True)
            want = torch.load(base / "straight" / "final.pt", weights_only=True)
            exact += all(torch.equal(got[k], want[k]) for k in want) and (base / "dead" / "ran").read_text() == "5"
            load += timings(base / "dead")["load"]
            save += timings(base / "straight")["save"]
            step += timings(base / "straight")["step"][1:]  # the first step includes warm-up
        sized = run_ranks(checkpoint_at_size, 2, str(Path(tmp) / "sized.ckpt"), args.repeats)
        size_mb = sum(f.stat().st_size for f in (Path(tmp) / "sized.ckpt").iterdir()) / 1e6
    d, h = Stat(dead), Stat(hung)
    big = {k: Stat([1000 * max(r[k][i] for r in sized) for i in range(len(sized[0][k]))]) for k in sized[0]}
    ms = {k: Stat([1000 * x for x in v]) for k, v in {"load": load, "save": save, "step": step}.items()}
    text = f"""{SECTION}

Command: `python benchmarks/reliability_bench.py --repeats {args.repeats}{' --write-docs ' + str(args.write_docs) if args.write_docs else ''}`
Machine: torch {torch.__version__}, Python {sys.version.split()[0]}, 2 CPU ranks (gloo) started by Lightning's subprocess launcher. Date: {time.strftime('%Y-%m-%d')}.

| fault | injected | stopped every rank, naming rank 1 | time to detect and exit (median, min..max) |
|---|---:|---:|---:|
| rank 1 SIGKILLed mid-epoch (step 7) | {len(dead)} | {named["dead"]} | {d.median:.1f} s ({d.lo:.1f}..{d.hi:.1f}) |
| rank 1 SIGSTOPped (hung) at step 3, `heartbeat_timeout={args.hang_timeout:g}` | {len(hung)} | {named["hung"]} | {h.median:.1f} s ({h.lo:.1f}..{h.hi:.1f}) |

- Recovered: `fit(ckpt_path="last")` from the step-5 checkpoint ended bit-identical to an uninterrupted run, having trained exactly the 5 missing steps, in {exact} of {args.repeats} runs. Work lost to the fault: the steps since the last checkpoint (here 2).
- Resume overhead, rank 0, ms (median, min..max): restoring the sharded checkpoint {ms["load"].median:.0f} ({ms["load"].lo:.0f}..{ms["load"].hi:.0f}); saving one {ms["save"].median:.0f} ({ms["save"].lo:.0f}..{ms["save"].hi:.0f}); a training step {ms["step"].median:.1f} ({ms["step"].lo:.1f}..{ms["step"].hi:.1f}). The test model is tiny (3 tables, 153 rows), so these are the fixed costs of the checkpoint path.
- At size (2 ranks, two 200,000 x 64 tables row-wise with Adagrad state, {size_mb:.0f} MB on disk; slowest rank, ms): atomic save {big["save"].median:.0f} ({big["save"].lo:.0f}..{big["save"].hi:.0f}), validated load {big["load"].median:.0f} ({big["load"].lo:.0f}..{big["load"].hi:.0f}), training step {big["step"].median:.0f} ({big["step"].lo:.0f}..{big["step"].hi:.0f}): a save costs about {big["save"].median / big["step"].median:.0f} steps, a resume's load about {big["load"].median / big["step"].median:.0f}.
"""
    print(text)
    if args.write_docs:
        replace_section(args.write_docs, SECTION, text)


if __name__ == "__main__":
    main()
