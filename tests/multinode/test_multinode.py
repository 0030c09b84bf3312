"""Several hosts for real: two namespace nodes of two ranks each (``nodes.py``), started as a cluster starts them.

* a 2x2 fit with a host-aware plan trains the same weights as one process, with shared memory
  inside each node and the process group between them (said at fit start), under Lightning's own
  launcher, torchrun and a SLURM-style environment;
* a frozen node (SIGSTOP, rank 0's too) or a killed one is named, with its ranks, by every
  surviving rank, which exits non-zero within ``heartbeat_timeout`` plus seconds;
* the checkpoint of a killed 2x2 run resumes on another layout (one node of 3 ranks) and ends
  where a straight run ends.

Skipped, with the reason, where namespaces cannot be made (not root, no ``unshare``).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "lightning"))
sys.path.insert(0, str(Path(__file__).parent))
import nodes  # noqa: E402
from _models import Rec, data, trainer  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.skipif(nodes.why_not() is not None, reason=str(nodes.why_not()))]

SCRIPT = "tests/multinode/_node.py"
STEPS, GLOBAL_BATCH = 12, 12
BOUND_S = 420  # a whole run on a loaded 2-core machine
HEARTBEAT_S = 5.0  # the tests' own (default 60 s); each fault case waits it out once


def finish(started: list[nodes.Node], bound: float = BOUND_S) -> list[int]:
    """Every node's exit code (ended by force past ``bound`` seconds: then -9)."""
    codes, deadline = [], time.monotonic() + bound
    for node in started:
        try:
            codes.append(node.proc.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            node.thaw_and_end()
            codes.append(-9)
    return codes


def one_process(steps: int = STEPS) -> dict[str, torch.Tensor]:
    model = Rec("adagrad")
    trainer(devices=1, max_steps=steps).fit(model, data(GLOBAL_BATCH, steps))
    return model.state_dict()


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.parametrize("launcher", ["lightning", "torchrun", "slurm"])
def test_two_nodes_train_like_one_process(tmp_path, launcher):
    started = nodes.start(tmp_path, [SCRIPT, str(tmp_path), "--steps", str(STEPS)], launcher)
    codes = finish(started)
    logs = "\n".join(n.output() for n in started)
    assert codes == [0, 0], logs[-4000:]
    assert "the plan assumed 2 hosts x 2 ranks; the ranks run on 2 hosts" in logs, logs[-4000:]
    assert "host 'node-a' (ranks 0-1): shared memory" in logs
    assert "host 'node-b' (ranks 2-3): shared memory" in logs
    assert "between hosts: the process group (gloo)" in logs
    assert_same(torch.load(tmp_path / "final.pt", weights_only=True), one_process())


def fault_run(out: Path, node: int, fault: str) -> tuple[list[int], float, str]:
    """A paced 2x2 run; past step 7, ``fault`` ("freeze" or "kill") hits ``node``: (codes, seconds, logs)."""
    argv = [SCRIPT, str(out), "--steps", "40", "--pace", "0.3", "--heartbeat-timeout", str(HEARTBEAT_S)]
    started = nodes.start(out, argv)
    step, deadline = out / "step", time.monotonic() + BOUND_S
    while not (step.exists() and step.read_text().strip() and int(step.read_text()) >= 7):
        assert time.monotonic() < deadline and all(n.proc.poll() is None for n in started), "no step 7"
        time.sleep(0.2)
    getattr(started[node], fault)()
    hit = time.monotonic()
    survivor = started[1 - node]
    codes = finish([survivor], bound=HEARTBEAT_S + 60)
    took = time.monotonic() - hit
    logs = survivor.output()
    started[node].thaw_and_end()
    return codes, took, logs


@pytest.mark.parametrize(
    ("node", "named"),
    [
        (0, "rank 0 is unreachable on host 'node-a' (ranks 0, 1); it serves the rendezvous store"),
        (1, "on host 'node-b' (ranks 2, 3)"),
    ],
)
def test_a_frozen_node_is_named_by_the_other_within_heartbeat_timeout(tmp_path, node, named):
    codes, took, logs = fault_run(tmp_path, node, "freeze")
    print(f"node {nodes.NAMES[node]} frozen: the other exited {codes[0]} after {took:.1f} s")
    assert codes[0] not in (0, -9), logs[-4000:]  # ended by itself, non-zero
    assert named in logs, logs[-4000:]
    assert took < HEARTBEAT_S + 30  # heartbeat_timeout plus seconds (a loaded machine), not for ever


def test_a_killed_node_is_named_and_its_checkpoint_resumes_on_one_node_of_three(tmp_path):
    codes, took, logs = fault_run(tmp_path, 1, "kill")
    print(f"node {nodes.NAMES[1]} killed: the other exited {codes[0]} after {took:.1f} s")
    assert codes[0] not in (0, -9), logs[-4000:]
    assert "lightning_shardrec: rank 2" in logs or "lightning_shardrec: rank 3" in logs, logs[-4000:]
    assert took < HEARTBEAT_S + 30
    assert not (tmp_path / "final.pt").exists()
    # another layout: one host of 3 ranks (Lightning's launcher), the same global batch
    resume = [sys.executable, SCRIPT, str(tmp_path), "--steps", "40", "--devices", "3", "--nodes", "1", "--resume"]
    done = subprocess.run(resume, capture_output=True, text=True, timeout=BOUND_S, cwd=nodes.ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert int((tmp_path / "ran").read_text()) in (30, 35)  # from the step-5 or step-10 checkpoint on, none redone
    assert_same(torch.load(tmp_path / "final.pt", weights_only=True), one_process(40))
