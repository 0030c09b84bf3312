"""The compiled loops as ``torch.library`` custom ops: schemas and fakes (opcheck), torch.compile and
torch.export over them, every argument check, and that static tables never build or load them."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from lightning_shardrec import DynamicConfig, EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from lightning_shardrec.modules import table_init
from lightning_shardrec.modules.dynamic import native, ops
from tests.modules._dynamic_reference import ODD_IDS

needs_loops = pytest.mark.skipif(native.native_loops() is None, reason="the package's compiled loops are not built")
I64 = torch.int64


def _mapper_state(width: int = 4, buckets: int = 3) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    held = torch.zeros(buckets * width, dtype=I64)
    last = torch.full((buckets * width,), -1, dtype=I64)
    return held, last, torch.zeros(buckets * width, dtype=I64)


def _locate_args(ids: torch.Tensor, train: bool = True) -> tuple:
    held, last, seen = _mapper_state()
    one = torch.tensor([3], dtype=I64)
    return (ids, None, one, torch.tensor([0]), one, torch.tensor([0]), torch.tensor([5]), 4, held, last, seen, train)


def _place_args(n: int = 5) -> tuple:
    ids = torch.tensor(sorted(ODD_IDS[:n]), dtype=I64)
    bucket = torch.tensor(sorted([0, 0, 1, 2, 2][:n]), dtype=I64)
    return (ids, bucket, torch.arange(1, n + 1), torch.tensor([7]), 4, False, *_mapper_state())


def _serve_args() -> tuple:
    held = torch.tensor(ODD_IDS, dtype=I64)
    live = torch.tensor([True, False] * 4)
    return (torch.tensor(ODD_IDS + [5, 6], dtype=I64), 2, 4, held, live, 8)


def _write_args() -> tuple:
    rows = torch.tensor([3, 0, 5])
    return (torch.zeros(6, 8), rows, torch.tensor([11, 12, 13]), torch.full((3,), -0.5, dtype=torch.float64),
            torch.full((3,), 0.5, dtype=torch.float64))  # fmt: skip


@needs_loops
@pytest.mark.parametrize(
    "op, args",
    [
        (ops.locate, _locate_args(torch.tensor(ODD_IDS))),
        (ops.locate, _locate_args(torch.tensor(ODD_IDS), train=False)),
        (ops.place, _place_args()),
        (ops.serve, _serve_args()),
        (ops.write_uniform_rows, _write_args()),
    ],
    ids=["locate", "locate-eval", "place", "serve", "write_uniform_rows"],
)
def test_ops_pass_torch_opcheck(op: object, args: tuple) -> None:
    """Schema (declared mutations), fake implementation, autograd registration, AOT dispatch."""
    torch.library.opcheck(op, args)


def _with(args: tuple, i: int, value: object) -> tuple:
    return args[:i] + (value,) + args[i + 1 :]


_BAD = [
    (ops.place, _with(_place_args(), 6, torch.zeros(12, dtype=torch.int32)),
     r"shardrec::place: held must be a contiguous 1-D torch.int64 CPU tensor, got torch.int32 \(12,\) on cpu"),
    (ops.place, _with(_place_args(), 0, torch.zeros(10, dtype=I64)[::2]),
     r"shardrec::place: ids must be a contiguous 1-D .* \(contiguous: False\)"),
    (ops.place, _with(_place_args(), 1, torch.tensor([0, 0, 1, 2, 3])),
     r"shardrec::place: bucket must lie in \[0, 3\), got 0..3"),
    (ops.place, _with(_place_args(), 1, torch.tensor([0, 2, 1, 2, 2])),
     r"shardrec::place: ids must come sorted by bucket, got buckets \[0, 2, 1"),
    (ops.place, _with(_place_args(), 3, torch.tensor([7, 7])),
     r"shardrec::place: step must have 1 or 5 elements \(one per id\), got 2"),
    (ops.place, _with(_place_args(), 2, torch.arange(4)), r"shardrec::place: total must have 5 elements, got 4"),
    (ops.place, _with(_place_args(), 4, 5),
     r"shardrec::place: held/last/count have 12 entries, not a multiple of width 5"),
    (ops.place, _with(_place_args(), 4, 0), r"shardrec::place: width must be in \[1, 1024\], got 0"),
    (ops.locate, _with(_locate_args(torch.tensor(ODD_IDS)), 1, torch.ones(8, dtype=I64)),
     r"shardrec::locate: table must lie in \[0, 1\), got 1..1"),
    (ops.locate, _with(_locate_args(torch.tensor(ODD_IDS)), 3, torch.tensor([0, 0])),
     r"shardrec::locate: lo must have 1 elements, got 2"),
    (ops.locate, _with(_locate_args(torch.tensor(ODD_IDS)), 2, torch.tensor([0])),
     r"shardrec::locate: num_buckets must lie in \[1, 4611686018427387904\), got 0..0"),
    (ops.locate, _with(_locate_args(torch.tensor(ODD_IDS)), 5, torch.tensor([1])),
     r"shardrec::locate: start \+ count must lie in \[0, 4\), got 4..4"),
    (ops.locate, (torch.tensor(ODD_IDS), None, *[torch.zeros(0, dtype=I64)] * 5, 4, *_mapper_state(), True),
     r"shardrec::locate: num_buckets must have at least one table, got 0"),
    (ops.serve, _with(_serve_args(), 4, torch.ones(8, dtype=torch.uint8)),
     r"shardrec::serve: live must be a contiguous 1-D torch.bool CPU tensor, got torch.uint8"),
    (ops.serve, _with(_serve_args(), 1, 3), r"shardrec::serve: held must have 12 elements, got 8"),
    (ops.serve, _with(_serve_args(), 1, 0), r"shardrec::serve: num_buckets must be at least 1, got 0"),
    (ops.write_uniform_rows, _with(_write_args(), 0, torch.zeros(6, 8, dtype=torch.float16)),
     r"shardrec::write_uniform_rows: weight must be a 2-D float32 or float64 CPU tensor, got torch.float16 \(6, 8\)"),
    (ops.write_uniform_rows, _with(_write_args(), 0, torch.zeros(8, 6).t()),
     r"shardrec::write_uniform_rows: weight's rows must be contiguous, got strides \(1, 6\)"),
    (ops.write_uniform_rows, _with(_write_args(), 1, torch.tensor([3, 6, 0])),
     r"shardrec::write_uniform_rows: rows must lie in \[0, 6\), got 0..6"),
    (ops.write_uniform_rows, _with(_write_args(), 3, torch.zeros(3)),
     r"shardrec::write_uniform_rows: low must be a contiguous 1-D torch.float64 CPU tensor, got torch.float32"),
]  # fmt: skip


@needs_loops
@pytest.mark.parametrize("op, args, match", _BAD, ids=[m.split(": ")[1][:40] for _, _, m in _BAD])
def test_ops_check_their_arguments_before_any_pointer_is_touched(op: object, args: tuple, match: str) -> None:
    before = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    with pytest.raises(ValueError, match=match):
        op(*args)  # type: ignore[operator]
    assert all(not isinstance(a, torch.Tensor) or torch.equal(a, b) for a, b in zip(args, before, strict=True))


def test_an_op_called_where_the_loops_are_not_built_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ops, "native_loops", lambda: None)
    with pytest.raises(
        RuntimeError,
        match=r"shardrec::serve: the compiled loops are not loaded here \(the package was installed without them",
    ):
        ops.serve(*_serve_args())


@pytest.mark.parametrize(
    "change, match",
    [
        ({"rows": torch.tensor([[1]])}, r"write_uniform_rows: weight must be \[rows, dim\] and rows, row_seeds, low, "),
        (
            {"rows": torch.tensor([1.0, 2.0, 3.0])},
            r"rows and row_seeds must be integer, got torch.float32, torch.int64",
        ),
        ({"rows": torch.tensor([0, 9, 2])}, r"write_uniform_rows: rows must lie in \[0, 6\), got 0..9"),
    ],
)
def test_write_uniform_rows_checks_its_rows(change: dict, match: str) -> None:
    weight, rows, seeds, low, high = _write_args()
    args = {"weight": weight, "rows": rows, "row_seeds": seeds, "low": low, "high": high, **change}
    with pytest.raises(ValueError, match=match):
        table_init.write_uniform_rows(**args)
    assert weight.eq(0).all()


@needs_loops
def test_ops_trace_whole_under_torch_compile_and_export() -> None:
    """No graph break at the ops (fullgraph), and an exported program holds them as calls."""

    class Serve(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            _, _, _, held, live, _ = _serve_args()
            self.register_buffer("held", held)
            self.register_buffer("live", live)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return ops.serve(ids, 2, 4, self.held, self.live, 8) + 1

    ids = _serve_args()[0]
    module = Serve()
    want = module(ids)
    assert torch.equal(torch.compile(module, backend="aot_eager", fullgraph=True)(ids), want)
    exported = torch.export.export(module, (ids,))
    assert "torch.ops.shardrec.serve.default" in exported.graph_module.code
    assert torch.equal(exported.module()(ids), want)

    def lookup(ids: torch.Tensor, held: torch.Tensor, last: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
        args = _locate_args(ids)
        bucket, slot, _ = ops.locate(*args[:8], held, last, seen, True)
        return bucket * 10 + slot

    state = _mapper_state()
    state[1][:] = 0  # all slots live, holding id 0
    eager_state = [t.clone() for t in state]
    got = torch.compile(lookup, backend="aot_eager", fullgraph=True)(torch.tensor(ODD_IDS), *state)
    assert torch.equal(got, lookup(torch.tensor(ODD_IDS), *eager_state))
    assert all(torch.equal(a, b) for a, b in zip(state, eager_state, strict=True))  # the hit recorded, once each


@needs_loops
@pytest.mark.slow  # compiles every piece between graph breaks (about a minute on 2 loaded cores)
def test_torch_compile_over_a_module_with_a_dynamic_table_trains_as_eager() -> None:
    torch.manual_seed(0)
    tables = [
        EmbeddingBagConfig(name="d", embedding_dim=4, num_embeddings=16, feature_names=["f"],
                           dynamic=DynamicConfig(num_buckets=4, min_count=2, ttl_steps=3)),
        EmbeddingBagConfig(name="s", embedding_dim=4, num_embeddings=10, feature_names=["g"]),
    ]  # fmt: skip
    eager = EmbeddingBagCollection(tables)
    twin = EmbeddingBagCollection(tables)
    twin.load_state_dict(eager.state_dict())
    compiled = torch.compile(twin, backend="aot_eager")
    gen = torch.Generator().manual_seed(1)
    for step in range(3):
        ids = torch.cat([torch.randint(-30, 30, (12,), generator=gen), torch.randint(0, 10, (6,), generator=gen)])
        kjt = KeyedJaggedTensor(["f", "g"], ids, lengths=torch.tensor([3, 3, 3, 3, 2, 2, 1, 1]))
        if step == 2:
            eager.eval(), twin.eval()
        a, b = eager(kjt).values(), compiled(kjt).values()
        assert torch.equal(a, b), step
        if step < 2:
            a.square().sum().backward()
            b.square().sum().backward()
            with torch.no_grad():
                for p, q in zip(eager.parameters(), twin.parameters(), strict=True):
                    p -= 0.1 * p.grad
                    q -= 0.1 * q.grad
                    p.grad = q.grad = None
    assert eager.dynamic_stats() == twin.dynamic_stats() and eager.dynamic_stats()["d"]["admissions"] > 0
    assert all(torch.equal(a, b) for a, b in zip(eager.state_dict().values(), twin.state_dict().values(), strict=True))


_NO_COMPILER = textwrap.dedent(
    """
    import ctypes, subprocess, sys, warnings
    import torch
    warnings.simplefilter("error")  # any warning fails the static part

    real_popen, real_cdll = subprocess.Popen, ctypes.CDLL
    loaded = []

    def popen(args, *rest, **kwargs):  # a compiler is refused, always
        name = str(args[0] if isinstance(args, (list, tuple)) else args).split("/")[-1]
        assert name not in ("cc", "gcc", "clang", "c++", "g++", "ninja"), f"spawned {args}"
        return real_popen(args, *rest, **kwargs)

    def cdll(name, *rest, **kwargs):
        assert "lightning_shardrec" not in str(name) or loaded, f"loaded {name}"
        return real_cdll(name, *rest, **kwargs)

    subprocess.Popen, ctypes.CDLL = popen, cdll
    from lightning_shardrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, DynamicConfig
    from lightning_shardrec.inference import QuantEmbeddingBagCollection
    from lightning_shardrec.modules.dynamic import native

    static = [EmbeddingBagConfig(name="s", embedding_dim=16, num_embeddings=50_000, feature_names=["f"])]
    ebc = EmbeddingBagCollection(static)
    kjt = KeyedJaggedTensor(["f"], torch.tensor([1, 2, 49_999]), lengths=torch.tensor([2, 1]))
    ebc(kjt).values().sum().backward()
    QuantEmbeddingBagCollection.from_float(ebc.eval(), "int8")(kjt)
    assert native.native_loops.cache_info().misses == 0, "static tables asked for the compiled loops"
    print("static: no compiler, no library")

    loaded.append(True)  # a dynamic table may load the package's library (never build one)
    if sys.argv[1:] == ["hidden"]:
        native.library_path = lambda folder=None: None  # as a package installed without it
    warnings.simplefilter("default")
    table = EmbeddingBagConfig(name="d", embedding_dim=4, num_embeddings=16, feature_names=["f"],
                               dynamic=DynamicConfig())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dyn = EmbeddingBagCollection([table])
        for _ in range(3):
            dyn(kjt).values().square().sum().backward()
    print("dynamic:", native.native_loops() is not None, [str(w.message) for w in caught])
    """
)


@pytest.mark.parametrize("library", ["built", "hidden"])
def test_static_and_dynamic_tables_train_without_a_compiler(tmp_path: Path, library: str) -> None:
    """No C compiler (PATH stripped, CC missing), spawning one refused: static tables build, train and quantize
    without loading anything; a dynamic table trains on the package's compiled loops without a warning, or,
    where the package has none, says (once) that its loops run as tensor ops."""
    if library == "built" and native.library_path() is None:
        pytest.fail("the package's compiled loops are not built in this checkout (python setup.py build_ext --inplace)")
    env = {"PATH": str(tmp_path), "CC": str(tmp_path / "no-cc"), "XDG_CACHE_HOME": str(tmp_path),
           "PYTHONPATH": str(Path.cwd())}  # fmt: skip
    args = [sys.executable, "-c", _NO_COMPILER, *(["hidden"] if library == "hidden" else [])]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "static: no compiler, no library" in done.stdout
    if library == "built":
        assert "dynamic: True []" in done.stdout
    else:
        assert "dynamic: False" in done.stdout and done.stdout.count("installed without its compiled loops") == 1
    assert not list(tmp_path.rglob("*.so"))
