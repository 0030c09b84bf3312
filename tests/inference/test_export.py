"""export -> load -> predict: the artifact reproduces the in-process quantized model."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _quant_models import TinyRec, data, trainer

from lightning_shardrec.errors import CheckpointError
from lightning_shardrec.inference import QuantEmbeddingBagCollection, QuantizedPredictor, load, quantize
from lightning_shardrec.inference.export import export, main

HERE = Path(__file__).parent


def _loader(weighted: bool = False):
    dm = data(weighted=weighted)
    dm.setup("test")
    return dm.test_dataloader()


def _batches(weighted: bool = False) -> list:
    return list(_loader(weighted))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A checkpoint written by a plain Trainer after a few steps (the strategy writes the same layout)."""
    torch.manual_seed(0)
    model = TinyRec()
    t = trainer(max_steps=4)
    t.fit(model, data())
    path = tmp_path_factory.mktemp("ckpt") / "last.ckpt"
    t.save_checkpoint(path)
    return path


@pytest.mark.parametrize("dtype", ["int8", "int4", "fp16"])
def test_export_load_predict_matches_in_process(checkpoint, tmp_path, dtype):
    state = torch.load(checkpoint, weights_only=True)
    reference = TinyRec(**state["hyper_parameters"])
    reference.load_state_dict(state["state_dict"])
    in_process = quantize(reference, dtype)
    out = tmp_path / "model.pt"
    export(checkpoint, TinyRec, dtype, out)
    artifact = torch.load(out, weights_only=True)  # plain data: no code in the file
    assert artifact["factory"] == "_quant_models:TinyRec" and artifact["dtype"] == dtype
    loaded = load(out)
    assert isinstance(loaded.ebc, QuantEmbeddingBagCollection) and loaded.ebc.dtype.value == dtype
    batches = _batches()
    with torch.no_grad():
        for batch in batches:
            torch.testing.assert_close(loaded(batch), in_process(batch), rtol=0, atol=0)
    # Trainer.predict on the loaded model (a LightningModule) and on a wrapped one
    preds = trainer().predict(loaded, dataloaders=_loader())
    wrapped = trainer().predict(QuantizedPredictor(load(out, backend="torch")), dataloaders=_loader())
    for p, w, batch in zip(preds, wrapped, batches, strict=True):
        with torch.no_grad():
            torch.testing.assert_close(p, in_process(batch), rtol=0, atol=0)
        torch.testing.assert_close(w, p, rtol=1e-6, atol=1e-6)


def test_export_from_module_with_dense_quantization(tmp_path):
    model = TinyRec(dim=4, weighted=True)
    out = tmp_path / "dense.pt"
    quantized = export(None, model, "int8", out, dense=True)
    assert not isinstance(model.ebc, QuantEmbeddingBagCollection)  # the given module is left as it was
    loaded = load(out)
    assert "quantized" in type(loaded.mlp[0]).__module__
    batches = _batches(weighted=True)
    with torch.no_grad():
        for batch in batches:
            torch.testing.assert_close(loaded(batch), quantized(batch), rtol=0, atol=0)
            torch.testing.assert_close(loaded(batch), model(batch), rtol=0.05, atol=0.05)


def test_cli_writes_artifact(checkpoint, tmp_path, capsys):
    out = tmp_path / "cli.pt"
    args = ["--ckpt", str(checkpoint), "--model", "_quant_models:TinyRec", "--out", str(out)]
    assert main([*args, "--dtype", "int4"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert load(out).ebc.dtype.value == "int4"
    with pytest.raises(SystemExit):
        main([*args, "--dtype", "int3"])
    assert "unknown quantized dtype 'int3'; available: int8, int4, fp16" in capsys.readouterr().err


def test_model_class_from_lightning_cli_checkpoint(checkpoint, tmp_path):
    state = torch.load(checkpoint, weights_only=True)
    state["hyper_parameters"] = {**state["hyper_parameters"], "_class_path": "_quant_models.TinyRec",
                                 "_instantiator": "lightning.pytorch.cli.instantiate_module"}
    torch.save(state, tmp_path / "cli.ckpt")
    assert main(["--ckpt", str(tmp_path / "cli.ckpt"), "--out", str(tmp_path / "m.pt")]) == 0
    artifact = torch.load(tmp_path / "m.pt", weights_only=True)
    assert artifact["factory"] == "_quant_models:TinyRec"
    assert artifact["factory_kwargs"] == {"dim": 8, "weighted": False}


def test_cli_as_python_module(checkpoint, tmp_path):
    out = tmp_path / "m.pt"
    cmd = [sys.executable, "-m", "lightning_shardrec.inference.export", "--ckpt", str(checkpoint),
           "--model", "_quant_models:TinyRec", "--dtype", "int8", "--out", str(out)]
    env = {**__import__("os").environ, "PYTHONPATH": str(HERE)}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert out.is_file()


def test_export_errors(checkpoint, tmp_path):
    class Local(TinyRec):
        pass

    with pytest.raises(ValueError, match=r"cannot be imported back by that name; define the model class"):
        export(None, Local(), "int8", tmp_path / "x.pt")
    with pytest.raises(ValueError, match=r"model factory must look like 'pkg.module:Name', got 'TinyRec'"):
        export(checkpoint, "TinyRec", "int8", tmp_path / "x.pt")
    with pytest.raises(FileNotFoundError, match=r"export: checkpoint '.*nope.ckpt' does not exist"):
        export(tmp_path / "nope.ckpt", TinyRec, "int8", tmp_path / "x.pt")
    with pytest.raises(ValueError, match=r"factory_kwargs\['dim'\] is a device; the artifact keeps only plain data"):
        export(checkpoint, TinyRec, "int8", tmp_path / "x.pt", factory_kwargs={"dim": torch.device("cpu")})
    with pytest.raises(CheckpointError, match=r"does not fit _quant_models:TinyRec"):
        export(checkpoint, TinyRec, "int8", tmp_path / "x.pt", factory_kwargs={"dim": 4})
    with pytest.raises(ValueError, match=r"does not record the model class .*pass the model as 'pkg.module:Name'"):
        export(checkpoint, None, "int8", tmp_path / "x.pt")
    torch.save({"state_dict": {}}, tmp_path / "plain.pt")
    with pytest.raises(CheckpointError, match=r"is not a lightning_shardrec.quantized artifact"):
        load(tmp_path / "plain.pt")


_SERVE = """
import sys, torch
from lightning_shardrec import KeyedJaggedTensor, _fbgemm
from lightning_shardrec.data import RecBatch
from lightning_shardrec.inference import load
batches = torch.load(sys.argv[2], weights_only=True)
outs = {}
for backend in ["torch"] + (["fbgemm"] if _fbgemm.fbgemm_inference_available() else []):
    model = load(sys.argv[1], backend=backend)
    with torch.no_grad():
        outs[backend] = [model(RecBatch(b["dense"], KeyedJaggedTensor(b["keys"], b["values"], lengths=b["lengths"]),
                                        b["labels"])) for b in batches]
torch.save(outs, sys.argv[3])
"""


def test_dynamic_table_export_cli_and_serving_in_a_fresh_process(tmp_path):
    """A dynamic table trained by a Trainer (rows evicted), exported by the CLI, served from raw ids
    in another process: identical to the in-process quantized model, within tolerance of the float one in eval."""
    from _quant_models import DynRec

    torch.manual_seed(0)
    model = DynRec()
    t = trainer(max_steps=6)
    t.fit(model, data(num_batches=6))
    stats = model.ebc.dynamic_stats()["t_user"]
    assert stats["evictions"] > 0
    t.save_checkpoint(tmp_path / "dyn.ckpt")
    out = tmp_path / "dyn.pt"
    assert main(["--ckpt", str(tmp_path / "dyn.ckpt"), "--model", "_quant_models:DynRec", "--out", str(out)]) == 0
    spec = torch.load(out, weights_only=True)["collections"]["ebc"]["tables"][0]
    assert spec["dynamic"] == {"eviction": "lru", "ttl_steps": 3, "min_count": 1, "num_buckets": None,
                               "candidates_per_bucket": None, "seed": 0}
    state = torch.load(tmp_path / "dyn.ckpt", weights_only=True)
    reference = DynRec(**state["hyper_parameters"])
    reference.load_state_dict(state["state_dict"])
    reference.eval()
    in_process = quantize(reference, "int8", inplace=False)
    batches = _batches()
    plain = [{"dense": b.dense, "labels": b.labels, "keys": b.sparse.keys(), "values": b.sparse.values(),
              "lengths": b.sparse.lengths()} for b in batches]
    torch.save(plain, tmp_path / "batches.pt")
    env = {**__import__("os").environ, "PYTHONPATH": f"{HERE}:{HERE.parent.parent}"}
    cmd = [sys.executable, "-c", _SERVE, str(out), str(tmp_path / "batches.pt"), str(tmp_path / "outs.pt")]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    served = torch.load(tmp_path / "outs.pt", weights_only=True)
    mapper = reference.ebc.dynamic_tables.mapper("t_user")
    missed = 0
    for i, batch in enumerate(batches):
        with torch.no_grad():
            expected, exact = in_process(batch), reference(batch)
        for outs in served.values():
            torch.testing.assert_close(outs[i], expected, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(outs[i], exact, rtol=0.02, atol=0.02)
        missed += int((mapper.lookup(batch.sparse["user"].values(), int(mapper.step), False).slots < 0).sum())
    assert missed > 0  # raw ids that are not live were served (as zeros)
