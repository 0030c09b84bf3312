"""``calibrate.py check``'s results: per plan the estimate, the measured step and the counted calls; the
docs section (table, ranking with ties, counts) and the scatter plot."""

from __future__ import annotations

from dataclasses import astuple, dataclass, fields
from pathlib import Path

from _calibrate_runs import BATCH, LOCAL, POOLING, TABLES, WORLD, Measured
from _comm_count import Tally

from lightning_shardrec.planner import Rates
from lightning_shardrec.planner.machine.rates import Calls

SECTION = "## Cost model against measured steps"
#: the counter's ``kind@group`` -> the cost model's :class:`Calls` field
CALL_KIND = {
    "all_to_all@world": "all_to_all",
    "all_to_all@host": "host_all_to_all",
    "reduce_scatter@world": "reduce_scatter",
    "all_gather@world": "all_gather",
    "all_reduce@world": "all_reduce",
    "ddp_all_reduce@world": "all_reduce",
}


def as_calls(tally: dict[str, Tally]) -> Calls:
    """A counted step as :class:`Calls`; a kind the model has no field for is named."""
    out = dict.fromkeys((f.name for f in fields(Calls)), 0)
    for kind, t in tally.items():
        if kind not in CALL_KIND:
            raise ValueError(f"counted collective {kind!r} has no place in the cost model's Calls")
        out[CALL_KIND[kind]] += t.calls
    return Calls(**out)


def busiest(per_rank: list[Calls]) -> Calls:
    """Per kind, the most calls any rank made (a step waits for its busiest rank)."""
    return Calls(*(max(n) for n in zip(*(astuple(c) for c in per_rank), strict=True)))


def calls_text(c: Calls) -> str:
    """``5 a2a + 2 host + 1 RS + 1 AG + 1 AR`` (non-zero kinds)."""
    short = ("a2a", "host a2a", "RS", "AG", "AR")
    return " + ".join(f"{n} {s}" for n, s in zip(astuple(c), short, strict=True) if n) or "none"


@dataclass(frozen=True)
class Row:
    """One plan: its estimate (s), measured step, calls counted in a step and derived from the plan."""

    name: str
    estimate: float
    measured: Measured
    counted: Calls
    modeled: Calls
    same_as: str | None = None  # an earlier plan with the identical layout

    @property
    def error(self) -> float:
        return self.estimate / self.measured.seconds - 1


def order_agreement(rows: list[Row]) -> tuple[int, int, list[tuple[str, str]]]:
    """Pairs whose measured round ranges do not overlap: how many the estimate orders the same, of how many;
    and the pairs within the measured spread (no order claimed)."""
    agree = clear = 0
    ties = []
    for i, a in enumerate(rows):
        for b in rows[i + 1 :]:
            if a.same_as == b.name or b.same_as == a.name:
                continue
            if a.measured.hi < b.measured.lo or b.measured.hi < a.measured.lo:
                clear += 1
                agree += (a.measured.seconds < b.measured.seconds) == (a.estimate < b.estimate)
            else:
                ties.append((a.name, b.name))
    return agree, clear, ties


def ranks(values: list[float]) -> list[int]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0] * len(values)
    for r, i in enumerate(order):
        out[i] = r + 1
    return out


def report(
    rows: list[Row],
    fixed: Measured,
    rates: Rates,
    measured: Rates,
    load: str,
    steps: int,
    rounds: int,
    plot: Path | None,
) -> str:
    """The docs section: ``rates`` are what the estimates used (``measured``'s, with the in-step rates
    of ``check``'s own rounds); ``fixed`` is the fixed step as timed in those rounds."""
    er, mr = ranks([r.estimate for r in rows]), ranks([r.measured.seconds for r in rows])
    lines = [
        SECTION,
        "",
        "Calibrate, then check (about 2 minutes on 2 cores; run on a quiet machine):",
        "",
        "```",
        "python benchmarks/calibrate.py measure --out rates.json",
        "python benchmarks/calibrate.py check --rates rates.json \\",
        "    --write-docs docs/planner.md --plot docs/img/planner_calibration.png",
        "```",
        "",
        "`Topology(..., rates='rates.json')` (or a `Rates`) opts in; without it the planner and its plans are "
        "unchanged. The file's bandwidths replace the defaults; each shard's lookup also pays the kernel's "
        "fixed `lookup_seconds` and its ids at the kernel's rate with rows in cache; the distinct rows it "
        "touches also pay `row_seconds` each (a cache miss: a column piece misses on its own) and "
        "`row_byte_seconds` per byte of their weights and optimizer state, in a phase every rank pays at the "
        "shared rate (the ids are taken as uniform, "
        "`perf.distinct_rows`, so skewed ids cost less); "
        "row-wise outputs run at the measured "
        "reduce-scatter rate; a replicated table pays its all-reduce and its dense gradient and update at "
        "measured rates. `step_estimate(plan, topology)` is the plan's critical path: a step is phases between "
        "collectives (per sharding group: ids in, lookup, output out and its gradient back, update; and the "
        "replicated tables' all-reduce and update), each as long as its slowest rank (`PlanStats.phase_cost`, "
        "`critical_path`). In the compute phases the ranks share the cores: the kernel rate was timed with "
        "every rank computing at once, so a rank computing alone runs `ranks_per_core` times faster (the ranks "
        "/ the cores `measure` ran on), but never all together faster than the shared rate. To that it adds the "
        "fixed step (a tiny replicated table: the dense model, its all-reduce, the header), the calls the plan "
        "makes beyond the fixed step's, each at its kind's in-step seconds (`step_calls`: counted per "
        "mechanism, derived from the plan's sharding types), the further sharded groups (a replicated "
        "table's lookup is local), and the further pieces (a "
        "table, or each column piece of a column-wise or grid table; a table_row_wise or grid piece adds its "
        "own).",
        "",
        "The in-step figures come from probes (`benchmarks/_calibrate_probes.py`): steps of small tables "
        "that differ in one thing. One tiny table per mechanism, against the fixed step, gives the seconds per "
        "call of each kind (divided by the calls the mechanism adds); two mechanisms together a further "
        "sharded group; twelve tiny tables against one a further piece, and twelve tables of 65,536 rows, 64 "
        "and 16 wide, against them (three per rank) the seconds per distinct row and per byte of it; six tiny "
        "table_row_wise tables against six table_wise ones what a host piece adds; two 26 MB "
        "replicated tables (two DDP buckets) against the fixed step scale `measure`'s all-reduce and "
        "dense-update rates; a 128-wide tiny table against an "
        "8-wide one slows the all-to-all bandwidths. Each probe is taken net of what the model already "
        "charges it, and each difference per round (the two probes ran one after the other), the median over "
        "rounds. `check` times the probes inside its own interleaved rounds and prices every layout with those "
        "figures, so the estimate and the measured plans see the same load; the kernel and reduce-scatter rates "
        "are `measure`'s.",
        "",
        f"Rates: {rates.source}; {load}. Kernel (rows in cache) {measured.memory_bw / 1e9:.2f} GB/s of per-id bytes "
        f"+ {measured.lookup_seconds * 1e3:.3f} ms per lookup; all-to-all alone in-host "
        f"{measured.intra_host_bw / 1e9:.2f} GB/s, between hosts {measured.inter_host_bw / 1e9:.2f} GB/s; "
        f"reduce-scatter {measured.reduce_scatter_bw / 1e9:.2f} GB/s; all-reduce alone "
        f"{measured.allreduce_bw / 1e9:.2f} GB/s; replicated table gradient and update alone "
        f"{measured.dense_bw / 1e9:.2f} GB/s of table; {measured.ranks_per_core:g} ranks per core. "
        f"In a step (`check`'s rounds): fixed step {rates.step_seconds * 1e3:.2f} ms, "
        f"{rates.collective_seconds * 1e3:.2f} ms per all-to-all, {rates.host_call_seconds * 1e3:.2f} ms per "
        f"in-host all-to-all, {rates.reduce_scatter_seconds * 1e3:.2f} ms per reduce-scatter or all-gather, "
        f"{rates.group_seconds * 1e3:.2f} ms per further group, {rates.table_seconds * 1e3:.2f} ms per further piece "
        f"(+{rates.host_table_seconds * 1e3:.2f} ms for a table_row_wise or grid piece); all-to-all in-host "
        f"{rates.intra_host_bw / 1e9:.2f} GB/s, between hosts {rates.inter_host_bw / 1e9:.2f} GB/s; distinct rows "
        f"{rates.row_seconds * 1e6:.3f} us each + {rates.row_byte_seconds * 1e12:.2f} us per MB; "
        "replicated tables at "
        f"{measured.dense_bw / rates.dense_bw:.2f}x "
        "`measure`'s seconds per byte.",
        "",
        f"Model: {len(TABLES)} tables ({', '.join(f'{n}x{d}' for n, d in TABLES.values())}), pooling {POOLING}, "
        f"batch {BATCH} per rank, adagrad, {WORLD // LOCAL} hosts x {LOCAL} gloo ranks (pretend hosts, one "
        "machine). Layouts (`benchmarks/_calibrate_runs.py`): column_wise cuts 16-wide pieces over the ranks; "
        "table_row_wise row-blocks each table over the 2 ranks of one host; grid_shard cuts the 64-wide tables "
        "in two column halves, each row-blocked over one host (the others as table_row_wise); mixed has the two "
        "large tables row_wise, the middle two table_wise and the small two data_parallel; planner is the "
        "planner's own choice.",
        "",
        f"Measured: the plans run interleaved in {rounds} rounds of {steps} steps; a step is the slowest rank's; "
        "the figure is the median over rounds of each round's median step, the range is the rounds' "
        "lowest and highest. Calls: counted in one step, the most any rank made per kind "
        "(`benchmarks/_comm_count.py`: a2a all-to-all, "
        "host a2a on a host's group, RS reduce-scatter, AG all-gather, AR all-reduce incl. DDP's) "
        "and derived from the plan by the model (`step_calls`).",
        "",
        "| plan | estimated ms | measured ms | rounds' range | error | rank est. | rank meas. "
        "| calls counted | model |",
        "|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r, a, b in zip(rows, er, mr, strict=True):
        m = r.measured
        name = r.name if r.same_as is None else f"{r.name} (= {r.same_as})"
        model = "same" if r.modeled == r.counted else calls_text(r.modeled)
        lines.append(
            f"| {name} | {r.estimate * 1e3:.2f} | {m.seconds * 1e3:.2f} | {m.lo * 1e3:.2f}-{m.hi * 1e3:.2f} "
            f"| {r.error:+.0%} | {a} | {b} | {calls_text(r.counted)} | {model} |"
        )
    within = sum(abs(r.error) <= 0.25 for r in rows)
    agree, clear, ties = order_agreement(rows)
    counts_ok = sum(r.modeled == r.counted for r in rows)
    lines += [
        "",
        f"{within} of {len(rows)} plans within 25%. Order: of the {clear} pairs of distinct plans whose measured "
        f"ranges do not overlap, the estimate orders {agree} the same way; "
        + (
            f"{len(ties)} pairs lie within the run-to-run spread (no order claimed): "
            + ", ".join(f"{a}/{b}" for a, b in ties)
            if ties
            else "no pair lies within the spread"
        )
        + f". Calls: the model's count equals the counted one for {counts_ok} of {len(rows)} plans.",
        "",
        f"The fixed step took {measured.step_seconds * 1e3:.2f} ms in `measure` and "
        f"{fixed.seconds * 1e3:.2f} ms ({fixed.lo * 1e3:.2f}-{fixed.hi * 1e3:.2f}) in these rounds: "
        f"{fixed.seconds / measured.step_seconds - 1:+.0%}, the drift of the machine's load between the two "
        "commands, which the same-round figures take out.",
    ]
    if plot is not None:
        lines += ["", f"![estimated vs measured step time]({Path('img') / plot.name})"]
    return "\n".join(lines) + "\n"


def scatter(rows: list[Row], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 5.5))
    ms = [r.measured.seconds * 1e3 for r in rows]
    es = [r.estimate * 1e3 for r in rows]
    markers = "osD^v<>phX*"
    for i, r in enumerate(rows):  # one marker per plan, named in the legend (the close ones overlap)
        m = r.measured
        err = [[(m.seconds - m.lo) * 1e3], [(m.hi - m.seconds) * 1e3]]
        label = f"{r.name} ({r.error:+.0%})" if r.same_as is None else f"{r.name} (= {r.same_as})"
        ax.errorbar(ms[i], es[i], xerr=err, fmt=markers[i % len(markers)], capsize=3, label=label)
    a, b = min(ms + es) * 0.7, max(ms + es) * 1.4
    ax.plot([a, b], [a, b], "k--", lw=0.8)
    ax.fill_between([a, b], [a * 0.75, b * 0.75], [a * 1.25, b * 1.25], alpha=0.15, label="within 25%")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8)
    ax.set_xlabel("measured ms / step (bars: rounds' range)")
    ax.set_ylabel("estimated ms / step")
    ax.set_title(title, fontsize=9)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, bbox_inches="tight")
