"""A quantized model as a ``torch.export`` program or an AOTInductor package: no model code to serve it.

:func:`export_program` traces the quantized model on example inputs into an
``ExportedProgram`` of plain aten ops: each ``QuantEmbeddingBagCollection`` is replaced by
:class:`~lightning_shardrec.inference.serving_ebc.ServingEmbeddingBags` (same outputs as the
torch backend; a dynamic table's frozen id map inside as sorted ids), plain
``nn.Embedding``/``nn.EmbeddingBag`` modules are already quantized modules of aten ops.
:func:`save_program` writes it as ``pt2`` (``torch.export.save``) or ``aoti``
(AOTInductor's ``aoti_compile_and_package``, through ``_compat.torch``).

The program takes the model's own positional inputs with the library's types spelled as
plain dicts of tensors, so that loading needs torch only (no pytree type to register)::

    Tensor                 as it is; its first dim is dynamic (the batch dim where it equals
                           the example's batch size)
    KeyedJaggedTensor      {"values": [N], "lengths": [K * B], "weights": [N] (weighted only)}
                           keys fixed at export, in the example's order; N and B dynamic
    RecBatch               {"dense": [B, D], "sparse": {KJT dict as above}}
    dict of tensors        each value as a Tensor above

    ids = kjt.values(); lengths = kjt.lengths()       # what a caller passes for a KJT
    program(dense, {"values": ids, "lengths": lengths})
"""

from __future__ import annotations

import copy
import json
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.export import Dim, ExportedProgram

from lightning_shardrec._compat import torch as compat
from lightning_shardrec.data.batch import RecBatch
from lightning_shardrec.inference.dense_int8 import exportable_dense
from lightning_shardrec.inference.quant_embedding_bag_collection import QuantEmbeddingBagCollection
from lightning_shardrec.inference.serving_ebc import ServingEmbeddingBags
from lightning_shardrec.sparse import KeyedJaggedTensor, KeyedTensor

PROGRAM_FORMAT = "lightning_shardrec.program"
PROGRAM_VERSION = 1
METADATA_FILE = "shardrec.json"  #: ``pt2``: an extra file; ``aoti``: the package metadata key


@dataclass(frozen=True)
class InputSpec:
    """How one positional input is passed to the program: ``kind`` in tensor/kjt/batch/dict."""

    kind: str
    keys: tuple[str, ...] = ()  #: a KJT's keys (kjt, batch); a dict's keys (dict)
    weighted: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "keys": list(self.keys), "weighted": self.weighted}


def input_specs(args: Sequence[Any]) -> list[InputSpec]:
    """The :class:`InputSpec` of each example input (Tensor, KJT, RecBatch or dict of tensors)."""
    specs = []
    for i, a in enumerate(args):
        if isinstance(a, Tensor):
            specs.append(InputSpec("tensor"))
        elif isinstance(a, KeyedJaggedTensor):
            specs.append(InputSpec("kjt", tuple(_kjt_checked(a, f"input {i}").keys()), a.weights_or_none() is not None))
        elif isinstance(a, RecBatch):
            kjt = _kjt_checked(a.sparse, f"input {i} (RecBatch.sparse)")
            specs.append(InputSpec("batch", tuple(kjt.keys()), kjt.weights_or_none() is not None))
        elif isinstance(a, Mapping) and all(isinstance(v, Tensor) for v in a.values()):
            specs.append(InputSpec("dict", tuple(a)))
        else:
            raise TypeError(
                f"export: input {i} is a {type(a).__name__}; a program takes Tensors, KeyedJaggedTensors, "
                "RecBatches and dicts of Tensors (wrap other inputs in a module that builds them)"
            )
    return specs


def plain_inputs(args: Sequence[Any]) -> tuple[Any, ...]:
    """``args`` as the program takes them (see the module docstring)."""
    return tuple(_plain(a) for a in args)


def _plain(a: Any) -> Any:
    if isinstance(a, KeyedJaggedTensor):
        out = {"values": a.values(), "lengths": a.lengths()}
        return out if a.weights_or_none() is None else {**out, "weights": a.weights()}
    if isinstance(a, RecBatch):
        return {"dense": a.dense, "sparse": _plain(a.sparse)}
    return dict(a) if isinstance(a, Mapping) else a


def _kjt_checked(kjt: KeyedJaggedTensor, where: str) -> KeyedJaggedTensor:
    if kjt.variable_stride_per_key():
        raise ValueError(f"export: {where} is a variable-batch (VBE) KeyedJaggedTensor; export with one batch size")
    return kjt


class ServingProgram(nn.Module):
    """``forward(*plain inputs)``: rebuilds the model's inputs and returns its output (tensors only)."""

    def __init__(self, model: nn.Module, specs: Sequence[InputSpec]) -> None:
        super().__init__()
        self.model = model
        self.specs = list(specs)

    def forward(self, *args: Any) -> Any:
        return _plain_output(self.model(*(_rebuild(s, a) for s, a in zip(self.specs, args, strict=True))))


def _rebuild(spec: InputSpec, a: Any) -> Any:
    if spec.kind == "kjt":
        lengths = a["lengths"]
        return KeyedJaggedTensor._trusted(
            list(spec.keys), a["values"], a.get("weights"), lengths, lengths.shape[0] // len(spec.keys)
        )
    if spec.kind == "batch":
        dense = a["dense"]
        kjt = _rebuild(InputSpec("kjt", spec.keys, spec.weighted), a["sparse"])
        return RecBatch(dense, kjt, dense.new_zeros(dense.shape[0]))
    return a


def _plain_output(out: Any) -> Any:
    if isinstance(out, KeyedTensor):
        return out.to_dict()
    if isinstance(out, (tuple, list)):
        return type(out)(_plain_output(o) for o in out)
    if isinstance(out, dict):
        return {k: _plain_output(v) for k, v in out.items()}
    return out


def batch_size(args: Sequence[Any]) -> int | None:
    """The example's batch size: the first KJT's (or RecBatch's) stride, else the commonest first dim
    among the tensors (the first of equals)."""
    for a in args:
        if isinstance(a, (KeyedJaggedTensor, RecBatch)):
            return (a if isinstance(a, KeyedJaggedTensor) else a.sparse).stride()
    sizes = [int(t.shape[0]) for a in args for t in (a.values() if isinstance(a, Mapping) else [a]) if t.dim()]
    return max(sizes, key=sizes.count) if sizes else None


def dynamic_shapes(specs: Sequence[InputSpec], plain: Sequence[Any], batch: int | None) -> tuple[Any, ...]:
    """Dynamic dims for ``torch.export``: one ``batch`` dim, ``K * batch`` lengths, a free dim per id count."""
    b = Dim("batch", min=1)
    count = iter(range(1 << 30))

    def tensor(t: Tensor) -> dict[int, Any] | None:
        if t.dim() == 0:
            return None
        return {0: b if batch is not None and t.shape[0] == batch else Dim(f"size_{next(count)}", min=0)}

    def kjt(spec: InputSpec, a: Mapping[str, Tensor]) -> dict[str, Any]:
        ids = Dim(f"ids_{next(count)}", min=0)
        out: dict[str, Any] = {"values": {0: ids}, "lengths": {0: len(spec.keys) * b}}
        return out | ({"weights": {0: ids}} if "weights" in a else {})

    shapes: list[Any] = []
    for spec, a in zip(specs, plain, strict=True):
        if spec.kind == "kjt":
            shapes.append(kjt(spec, a))
        elif spec.kind == "batch":
            shapes.append({"dense": tensor(a["dense"]), "sparse": kjt(spec, a["sparse"])})
        elif spec.kind == "dict":
            shapes.append({k: tensor(v) for k, v in a.items()})
        else:
            shapes.append(tensor(a))
    return tuple(shapes)


def serving_copy(model: nn.Module) -> nn.Module:
    """A copy of the quantized ``model`` in exportable modules (no gradients, eval mode)."""
    serving = exportable_dense(copy.deepcopy(model))  # torch.ao int8 Linear -> the same in aten ops
    targets = [n for n, m in serving.named_modules() if isinstance(m, QuantEmbeddingBagCollection)]
    for name in targets:
        qebc = serving.get_submodule(name)
        if not name:
            serving = ServingEmbeddingBags(qebc)  # type: ignore[arg-type]
            break
        parent_name, _, child = name.rpartition(".")
        setattr(serving.get_submodule(parent_name) if parent_name else serving, child, ServingEmbeddingBags(qebc))  # type: ignore[arg-type]
    for p in serving.parameters():
        p.requires_grad_(False)
    for m in serving.modules():  # views (e.g. two halves of one triu_indices) saved as their own tensors
        for name, b in m._buffers.items():
            if b is not None and b.untyped_storage().nbytes() != b.numel() * b.element_size():
                m._buffers[name] = b.clone()
    return serving.eval()


def export_program(
    model: nn.Module,
    example_inputs: Sequence[Any],
    *,
    shapes: Sequence[Any] | None = None,
    device: str | torch.device = "cpu",
) -> tuple[ExportedProgram, list[InputSpec]]:
    """``torch.export`` the quantized ``model`` on ``example_inputs`` (its own positional inputs).

    Checks the program's outputs on the example against ``model``'s and raises if they differ.
    ``shapes``: ``dynamic_shapes`` for the plain inputs, instead of the default ones.
    ``device``: where the program (its weights and inputs) lives, e.g. ``"cuda"`` for an
    AOTInductor package compiled for the GPU.
    """
    args = tuple(example_inputs)
    specs = input_specs(args)
    device = torch.device(device)
    plain = compat.tree_map(lambda t: t.to(device), plain_inputs(args))
    program = ServingProgram(serving_copy(model).to(device), specs)
    dims = dynamic_shapes(specs, plain, batch_size(args)) if shapes is None else tuple(shapes)
    with compat.size_oblivious_export(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        ep = torch.export.export(program, plain, dynamic_shapes=(dims,))  # one entry: forward(*args)
    with torch.no_grad():
        want = _plain_output(model.eval()(*args))
        got = compat.tree_map(lambda t: t.cpu(), ep.module()(*plain))
    try:
        compat.tree_map(lambda g, w: torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6), got, want)
    except AssertionError as err:
        raise ValueError(
            f"export: the exported program's outputs differ from the model's on the example: {err}"
        ) from None
    return ep, specs


def metadata(specs: Sequence[InputSpec], extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """What the artifact records besides the program (``shardrec.json``)."""
    return {
        "format": PROGRAM_FORMAT,
        "version": PROGRAM_VERSION,
        "torch": torch.__version__,
        "inputs": [s.as_dict() for s in specs],
        **dict(extra or {}),
    }


def save_program(ep: ExportedProgram, out: str | Path, fmt: str, info: Mapping[str, Any]) -> Path:
    """Write ``ep`` as ``fmt`` ``"pt2"`` (ExportedProgram) or ``"aoti"`` (AOTInductor package, compiled
    for the program's device) to ``out``, with ``info`` as JSON metadata."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(dict(info), sort_keys=True)
    if fmt == "pt2":
        torch.export.save(ep, out, extra_files={METADATA_FILE: text})
    elif fmt == "aoti":
        compat.aoti_compile_and_package(
            ep, package_path=str(out), inductor_configs={"aot_inductor.metadata": {METADATA_FILE: text}}
        )
    else:
        raise ValueError(f"save_program: format must be 'pt2' or 'aoti', got {fmt!r}")
    return out


def read_metadata(path: str | Path) -> dict[str, Any]:
    """The ``shardrec.json`` metadata of a ``pt2`` file (torch only: no program is built)."""
    import zipfile

    with zipfile.ZipFile(path) as z:
        name = next((n for n in z.namelist() if n.endswith(f"extra/{METADATA_FILE}")), None)
        if name is None:
            raise ValueError(f"{str(path)!r} has no {METADATA_FILE}: not written by lightning_shardrec's export")
        return json.loads(z.read(name))  # type: ignore[no-any-return]
