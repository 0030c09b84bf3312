"""Fuzz the Criteo readers with mangled lines, random bytes and corrupted preprocessed files.

The TSV reader, on any input: with ``on_bad_line="error"`` it yields exactly what a
line-by-line reference parser makes of the file or raises ``ValueError`` naming the file
and the first bad line; with ``"skip"`` it never raises, and ``rows`` + ``bad_lines`` is
the number of lines. The binary reader, given a corrupted ``meta.json`` or ``.npy``,
raises ``ValueError`` naming the file, or reads rows of the recorded shapes. No other
exception type and no hang (inputs are small; a hang would time the suite out).
"""

from __future__ import annotations

import gzip
import math
import re
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from lightning_shardrec.data.criteo import NUM_COLUMNS, NUM_DENSE, NUM_SPARSE, CriteoReader
from lightning_shardrec.data.criteo_binary import CriteoBinary, preprocess_criteo

SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SIZES = [7, 1000, 2**40] + [97] * (NUM_SPARSE - 3)

# --- lines: valid ones, then mangled ---------------------------------------------------------
dense_tok = st.one_of(st.just(""), st.integers(-(2**63), 2**63 - 1).map(str), st.integers(-5, 5000).map(str))
hex_tok = st.one_of(
    st.just(""), st.integers(0, 2**64 - 1).map(lambda v: f"{v:x}"), st.integers(0, 2**32).map(lambda v: f"{v:08X}")
)


@st.composite
def valid_line(draw: st.DrawFn) -> bytes:
    label = draw(st.sampled_from(["0", "1"]))
    dense = draw(st.lists(dense_tok, min_size=NUM_DENSE, max_size=NUM_DENSE))
    cats = draw(st.lists(hex_tok, min_size=NUM_SPARSE, max_size=NUM_SPARSE))
    return "\t".join([label, *dense, *cats]).encode()


NASTY = [
    b"\t",
    b"-",
    b"+",
    b"x",
    b" ",
    b"\x00",
    b"\xff",
    b".",
    b"e",
    b"\r",
    b"9" * 20,
    b"f" * 17,
    b"",
    b"\t\t",
    b"\xc3\xa9",
]


@st.composite
def mangled_line(draw: st.DrawFn) -> bytes:
    """A valid line with 0-3 edits: replace/insert/delete a span, drop or duplicate a column."""
    line = draw(valid_line())
    for _ in range(draw(st.integers(0, 3))):
        op = draw(st.sampled_from(["replace", "insert", "delete", "drop_col", "dup_col", "truncate"]))
        i = draw(st.integers(0, len(line)))
        if op == "replace":
            line = line[:i] + draw(st.sampled_from(NASTY)) + line[i + 1 :]
        elif op == "insert":
            line = line[:i] + draw(st.sampled_from(NASTY)) + line[i:]
        elif op == "delete":
            line = line[:i] + line[i + draw(st.integers(1, 5)) :]
        elif op == "truncate":
            line = line[:i]
        else:
            cols = line.split(b"\t")
            j = draw(st.integers(0, len(cols) - 1))
            cols = cols[:j] + cols[j + 1 :] if op == "drop_col" else cols[: j + 1] + cols[j:]
            line = b"\t".join(cols)
    return line


def reference_parse(line: bytes, sizes: list[int]) -> tuple[float, list[float], list[int]] | None:
    """The documented format, one line at a time: ``(label, dense, ids)``, or ``None`` if malformed."""
    tok = line.split(b"\t")
    if len(tok) != NUM_COLUMNS or tok[0] not in (b"0", b"1"):
        return None
    dense = []
    for t in tok[1 : 1 + NUM_DENSE]:
        if t and not re.fullmatch(rb"-?[0-9]+", t):
            return None
        v = int(t) if t else 0
        if not -(2**63) <= v < 2**63:
            return None
        dense.append(float(np.log1p(np.float32(max(v, 0)))))
    ids = []
    for t, n in zip(tok[1 + NUM_DENSE :], sizes, strict=True):
        if t and (not re.fullmatch(rb"[0-9a-fA-F]+", t) or len(t) > 16):
            return None
        ids.append((int(t, 16) if t else 0) % n)
    return float(tok[0] == b"1"), dense, ids


def file_lines(data: bytes) -> list[bytes]:
    """The lines a line iterator sees, with their ``\\r\\n`` stripped as the reader does."""
    if not data:
        return []
    parts = data.split(b"\n")
    if data.endswith(b"\n"):
        parts = parts[:-1]
    return [p.rstrip(b"\r\n") for p in parts]


def read_all(reader: CriteoReader) -> tuple[list[float], list[list[float]], list[list[int]]]:
    labels, dense, sparse = [], [], []
    for chunk in reader:
        labels += chunk.labels.tolist()
        dense += chunk.dense.tolist()
        sparse += chunk.sparse.tolist()
    return labels, dense, sparse


def check_tsv(path: Path, data: bytes, chunk_rows: int) -> None:
    """The reader on ``path`` (holding ``data`` uncompressed) against the reference, both modes."""
    lines = file_lines(data)
    parsed = [reference_parse(line, SIZES) for line in lines]
    good = [p for p in parsed if p is not None]
    first_bad = next((i + 1 for i, p in enumerate(parsed) if p is None), None)

    strict = CriteoReader(path, num_embeddings=SIZES, chunk_rows=chunk_rows)
    try:
        labels, dense, sparse = read_all(strict)
    except ValueError as e:
        assert first_bad is not None, f"good file rejected: {e}"
        assert re.search(rf"criteo file .*{re.escape(path.name)}: line {first_bad}: ", str(e)), str(e)
    else:
        assert first_bad is None, f"line {first_bad} {lines[first_bad - 1]!r} accepted"
        assert labels == [p[0] for p in good]
        assert sparse == [p[2] for p in good]
        assert all(
            math.isclose(a, b, rel_tol=1e-6)
            for r, p in zip(dense, good, strict=True)
            for a, b in zip(r, p[1], strict=True)
        )

    lenient = CriteoReader(path, num_embeddings=SIZES, chunk_rows=chunk_rows, on_bad_line="skip")
    labels, _, sparse = read_all(lenient)
    assert lenient.rows == len(good) and lenient.bad_lines == len(lines) - len(good)
    assert sparse == [p[2] for p in good] and labels == [p[0] for p in good]


@SETTINGS
@given(
    lines=st.lists(st.one_of(valid_line(), mangled_line()), max_size=12),
    crlf=st.booleans(),
    final_newline=st.booleans(),
    chunk_rows=st.integers(1, 5),
)
def test_mangled_lines_are_named_or_skipped(
    lines: list[bytes], crlf: bool, final_newline: bool, chunk_rows: int
) -> None:
    data = (b"\r\n" if crlf else b"\n").join(lines) + (b"\n" if final_newline and lines else b"")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "day_0"
        path.write_bytes(data)
        check_tsv(path, data, chunk_rows)


@SETTINGS
@given(data=st.binary(max_size=600), chunk_rows=st.integers(1, 4))
def test_random_bytes_are_named_or_skipped(data: bytes, chunk_rows: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "train.txt"
        path.write_bytes(data)
        check_tsv(path, data, chunk_rows)


def fixed_line(k: int) -> bytes:
    """A valid line, different for each ``k`` (for explicit examples)."""
    dense = [str(k * 13 + j) for j in range(NUM_DENSE)]
    cats = [f"{(k * 26 + j) * 2654435761 % 2**32:x}" for j in range(NUM_SPARSE)]
    return "\t".join(["1", *dense, *cats]).encode()


@SETTINGS
@given(
    lines=st.lists(valid_line(), min_size=1, max_size=6),
    cut=st.integers(0, 10_000),
    garbage=st.binary(max_size=40),
)
# cut 5 bytes short of line 3's end: the junk inflates to "\na\t6181f", so gzip.open returned
# line 3 as "...\t96af" (its last id cut from 96af9a3d) with a newline before zlib saw the EOF
@example(lines=[fixed_line(k) for k in range(3)], cut=451, garbage=b"\x97p\n\xea")
def test_truncated_or_corrupt_gzip_is_named_or_counted(lines: list[bytes], cut: int, garbage: bytes) -> None:
    """A ``.gz`` cut short or with garbage appended: a named error, or (skip) one bad line that ends the file."""
    blob = gzip.compress(b"\n".join(lines) + b"\n")
    blob = blob[: cut % (len(blob) + 1)] + garbage
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "day_3.gz"
        path.write_bytes(blob)
        try:
            rows = sum(len(c) for c in CriteoReader(path, num_embeddings=SIZES))
        except ValueError as e:
            assert re.search(r"criteo file .*day_3\.gz: line \d+: ", str(e)), str(e)
        else:
            assert rows == len(lines)  # intact stream (garbage after it may be ignored)
        lenient = CriteoReader(path, num_embeddings=SIZES, on_bad_line="skip")
        _, _, sparse = read_all(lenient)
        want = [reference_parse(line, SIZES)[2] for line in lines]  # type: ignore[index]
        assert sparse == want[: len(sparse)], "a row of a cut stream differs (a half line read as whole?)"
        assert lenient.rows == len(sparse) and lenient.bad_lines <= 1 + len(garbage)


# --- the binary (preprocessed) reader ------------------------------------------------------------
@pytest.fixture(scope="module")
def processed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small preprocessed directory (two source files) to corrupt copies of."""
    src = tmp_path_factory.mktemp("criteo_src")
    rng = np.random.default_rng(0)
    for name, n in (("day_0", 30), ("day_1", 20)):
        rows = []
        for _ in range(n):
            dense = [str(int(x)) for x in rng.integers(-3, 500, NUM_DENSE)]
            cats = [f"{int(x):x}" for x in rng.integers(0, 2**32, NUM_SPARSE)]
            rows.append("\t".join([str(int(rng.integers(0, 2))), *dense, *cats]))
        (src / name).write_text("\n".join(rows) + "\n")
    out = tmp_path_factory.mktemp("criteo_processed")
    preprocess_criteo([src / "day_0", src / "day_1"], out, num_embeddings=SIZES)
    return out


def check_binary(root: Path, named: str) -> None:
    """Open and read everything: a ``ValueError`` naming ``named``, or rows of the recorded shapes."""
    try:
        data = CriteoBinary(root)
    except ValueError as e:
        assert named in str(e), str(e)
        return
    chunk = data.read(0, len(data))
    assert chunk.dense.shape == (len(data), NUM_DENSE) and chunk.sparse.shape == (len(data), NUM_SPARSE)
    assert chunk.labels.shape == (len(data),)


@SETTINGS
@given(
    target=st.sampled_from(["meta.json", "day_0.dense.npy", "day_0.sparse.npy", "day_1.labels.npy"]),
    how=st.sampled_from(["random", "truncate", "splice"]),
    blob=st.binary(max_size=300),
    at=st.integers(0, 10_000),
)
def test_corrupt_preprocessed_files_are_named(processed: Path, target: str, how: str, blob: bytes, at: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "p"
        shutil.copytree(processed, root)
        path = root / target
        old = path.read_bytes()
        i = at % (len(old) + 1)
        if how == "random":
            new = blob
        elif how == "truncate":
            new = old[:i]
        else:  # overwrite bytes in place (header or payload)
            new = old[:i] + blob + old[i + len(blob) :]
        path.write_bytes(new)
        check_binary(root, target)


@SETTINGS
@given(
    edit=st.sampled_from(["rows", "sparse_dtype", "version", "files", "num_embeddings", "stem"]),
    value=st.one_of(st.integers(-5, 10**6), st.text(max_size=8), st.none(), st.lists(st.integers(), max_size=3)),
)
def test_meta_json_with_wrong_fields_is_named(processed: Path, edit: str, value: object) -> None:
    """A ``meta.json`` that parses but lies (rows, dtype, version ...): a named error, never a wrong read."""
    import json

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "p"
        shutil.copytree(processed, root)
        meta = json.loads((root / "meta.json").read_text())
        if edit in ("rows", "stem"):
            meta["files"][0][edit] = value
        else:
            meta[edit] = value
        (root / "meta.json").write_text(json.dumps(meta))
        try:
            data = CriteoBinary(root)
        except ValueError as e:
            assert str(e).startswith("criteo "), str(e)
            return
        # it loaded: then what it claims must be what is on disk (no files: an empty conversion)
        assert len(data) == (50 if meta["files"] else 0)
        chunk = data.read(0, len(data))
        assert chunk.sparse.shape == (len(data), NUM_SPARSE)


def test_a_meta_json_naming_a_missing_source_names_both(processed: Path) -> None:
    """A corrupted stem in ``meta.json`` (found by the fuzz test above: ``day_1`` -> `` ay_1``) points at files
    that do not exist: the error names the file and where its name came from."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "p"
        shutil.copytree(processed, root)
        meta = root / "meta.json"
        meta.write_text(meta.read_text().replace('"day_1"', '" ay_1"'))
        named = r"ay_1\.dense\.npy \(source ' ay_1' in meta\.json\) is missing or corrupt"
        with pytest.raises(ValueError, match=named):
            CriteoBinary(root)
