"""How to build the CPU loops: the compiled C loops against numpy and tensor ops, and two ways to build them.

    python benchmarks/native_loops_bench.py [--reps 9] [--cpp-extension]

One process, one intra-op thread; each case runs its variants in turn, ``--reps`` times,
and reports the median time of each and the median of the per-round ratios (paired, so a
machine's drift moves both). Cases:

- ``static init``: ``init_block`` of a 200,000 x 64 float32 table (what every static
  table's build runs on CPU): numpy's uint64 passes (the shipped path), the C loop
  ``shardrec_uniform_rows`` (what static tables used before), torch tensor ops (the CUDA
  path, run on CPU).
- ``fresh rows``: ``write_uniform_rows`` of 4,300 rows x 64 into a 1,000,000-row table (a
  dynamic table's admissions of one e2e step): op ``shardrec::write_uniform_rows`` (in
  place) against numpy rows + ``index_copy_``.
- ``serve``: ``QuantIdMap`` over 66,000 raw ids, 2**20 slots: op ``shardrec::serve``
  against its tensor-op twin.
- ``op overhead``: ``shardrec::serve`` of one id through the custom op against the bare
  ctypes call.
- build (``--cpp-extension`` adds torch's C++ extension machinery, ~25 s): ``setup.py``'s
  extension (what ``pip install`` builds) into a fresh directory.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import Stat, cpu_model, paired  # noqa: E402

from lightning_shardrec import DynamicConfig, EmbeddingBagConfig  # noqa: E402
from lightning_shardrec.inference import id_map  # noqa: E402
from lightning_shardrec.inference.id_map import QuantIdMap  # noqa: E402
from lightning_shardrec.modules import table_init  # noqa: E402
from lightning_shardrec.modules.dynamic import native, ops  # noqa: E402
from lightning_shardrec.modules.dynamic.hashing import mix64  # noqa: E402


def static_init(loops: native.NativeLoops, reps: int) -> dict[str, tuple[Stat, Stat]]:
    config = EmbeddingBagConfig(name="t", embedding_dim=64, num_embeddings=200_000, feature_names=["f"])
    out, seed = torch.empty(200_000, 64), 1234
    low, high = config.init_range()

    def c_loop() -> None:  # the old static path: one call per 512-row block, as init_block made it
        step = (1 << 15) // 64
        for start in range(0, 200_000, step):
            n = min(step, 200_000 - start)
            seeds = (mix64(torch.arange(start, start + n)) + seed).contiguous()
            lo, hi = torch.full((n,), low, dtype=torch.float64), torch.full((n,), high, dtype=torch.float64)
            loops.uniform_rows(n, 64, 0, seeds.data_ptr(), lo.data_ptr(), hi.data_ptr(), 1,
                               out[start:].data_ptr(), None, 0, 0)  # fmt: skip

    ref = torch.empty_like(out)
    table_init.init_block(config, seed, ref)
    c_loop()
    assert torch.equal(out, ref), "the C loop and numpy disagree"

    return paired(
        {
            "numpy, 1 thread (shipped)": lambda: table_init.init_block(config, seed, out),
            "C loop, 1 thread (before)": c_loop,
            "tensor ops, 1 thread": lambda: table_init._init_torch(seed, low, high, out, 0, 0),
        },
        reps,
    )


def fresh_rows(reps: int) -> dict[str, tuple[Stat, Stat]]:
    gen = torch.Generator().manual_seed(0)
    weight = torch.zeros(1_000_000, 64)
    rows = torch.randperm(1_000_000, generator=gen)[:4300]
    seeds = torch.randint(0, 2**62, (4300,), generator=gen)
    low = torch.full((4300,), -0.01, dtype=torch.float64)
    high = -low

    def numpy_rows() -> None:
        weight.index_copy_(0, rows, table_init.uniform_rows(seeds, 64, low, high, weight.dtype))

    return paired(
        {
            "op shardrec::write_uniform_rows": lambda: ops.write_uniform_rows(weight, rows, seeds, low, high),
            "numpy rows + index_copy_": numpy_rows,
        },
        reps,
    )


def serve(reps: int) -> dict[str, tuple[Stat, Stat]]:
    gen = torch.Generator().manual_seed(0)
    qmap = QuantIdMap("t", DynamicConfig(num_buckets=1 << 16), 1 << 20)
    held = torch.randint(-(2**62), 2**62, (1 << 20,), generator=gen)
    qmap.ids.copy_(held)
    qmap.live.fill_(True)
    ids = torch.cat([held[torch.randint(0, 1 << 20, (50_000,), generator=gen)], torch.arange(16_000)])
    saved = id_map.native_loops

    def twin() -> torch.Tensor:
        id_map.native_loops = lambda: None  # type: ignore[assignment]
        try:
            return qmap(ids)
        finally:
            id_map.native_loops = saved

    return paired({"op shardrec::serve": lambda: qmap(ids), "tensor ops": twin}, reps)


def op_overhead(loops: native.NativeLoops, reps: int) -> dict[str, tuple[Stat, Stat]]:
    held, live, ids = torch.zeros(16, dtype=torch.int64), torch.ones(16, dtype=torch.bool), torch.tensor([3])
    out = torch.empty(1, dtype=torch.int64)

    def op() -> None:
        for _ in range(1000):
            ops.serve(ids, 4, 4, held, live, 16)

    def bare() -> None:
        for _ in range(1000):
            loops.serve(1, ids.data_ptr(), 4, 4, held.data_ptr(), live.data_ptr(), 16, out.data_ptr())

    return paired({"custom op (1000 calls)": op, "bare ctypes (1000 calls)": bare}, reps)


def build_times(cpp_extension: bool) -> dict[str, float]:
    root = Path(__file__).resolve().parents[1]
    times = {}
    with tempfile.TemporaryDirectory() as tmp:  # what `pip install` / `pip wheel` runs: setup.py's extension
        t = time.perf_counter()
        cmd = [sys.executable, "setup.py", "-q", "build_ext", "--build-lib", tmp, "--build-temp", f"{tmp}/obj"]
        subprocess.run(cmd, cwd=root, check=True, capture_output=True)
        times["setup.py build_ext: plain C, system compiler (shipped)"] = time.perf_counter() - t
        built = native.library_path(Path(tmp) / "lightning_shardrec" / "modules" / "dynamic")
        assert built is not None, "setup.py built no library"
        native.load(built)
    if cpp_extension:
        from torch.utils import cpp_extension as ext

        cpp = (
            "#include <torch/library.h>\n#include <ATen/ATen.h>\n"
            "at::Tensor serve(const at::Tensor& ids) { return ids.clone(); }\n"
            'TORCH_LIBRARY(shardrec_bench, m) { m.def("serve(Tensor ids) -> Tensor"); }\n'
            'TORCH_LIBRARY_IMPL(shardrec_bench, CPU, m) { m.impl("serve", &serve); }\n'
        )
        with tempfile.TemporaryDirectory() as tmp:
            t = time.perf_counter()
            ext.load_inline("shardrec_bench", cpp, build_directory=tmp, extra_cflags=["-O3"], is_python_module=False)
            times["torch.utils.cpp_extension, one op (torch headers, ninja)"] = time.perf_counter() - t
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--cpp-extension", action="store_true", help="also time torch's C++ extension build")
    args = parser.parse_args()
    torch.set_num_threads(1)
    loops = native.native_loops()
    assert loops is not None, "the package's compiled loops are not built (python setup.py build_ext --inplace)"
    print(f"{cpu_model()}, torch {torch.__version__}, 1 thread, {args.reps} paired rounds\n")
    print("| case | variant | median | ratio to the first |\n|---|---|---:|---:|")
    for case, result in (
        ("static init 200,000 x 64", static_init(loops, args.reps)),
        ("fresh rows 4,300 x 64", fresh_rows(args.reps)),
        ("serve 66,000 ids, 2^20 slots", serve(args.reps)),
        ("op overhead", op_overhead(loops, args.reps)),
    ):
        for name, (sec, ratio) in result.items():
            print(f"| {case} | {name} | {sec.median * 1e3:.2f} ms | {ratio.median:.2f} |")
    print("\n| build (fresh directory) | seconds |\n|---|---:|")
    for name, sec in build_times(args.cpp_extension).items():
        print(f"| {name} | {sec:.2f} |")


if __name__ == "__main__":
    main()
