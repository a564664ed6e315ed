"""The training example's checkpoints are one step or they are refused (issue 58, class 4): every shard of a
sharded checkpoint names its index's step and its own place in it; NaN optimiser state is named at load."""
import json
import os
import subprocess
import sys

import hpmoe

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "train_moe_lm.py")
TINY = ["--layers", "1", "--d", "32", "--heads", "2", "--inter", "32", "--experts", "4", "--seq", "16", "--batch", "4",
        "--no-twin"]


def train(out, *args):
    return subprocess.run([sys.executable, EXAMPLE, *TINY, *args, "--out", str(out)], capture_output=True, text=True)


def refused(tmp_path, resume, says):
    r = train(tmp_path / "resumed", "--steps", "8", "--resume", str(resume))
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error:") and says in lines[0], r.stderr


def test_shards_of_different_steps_are_refused(tmp_path):
    """An index whose shards come from two saves (what a save that failed on one process leaves) is refused,
    naming the shard and both steps, instead of resuming with the step of one and the parameters of another."""
    for steps in ("2", "4"):
        r = train(tmp_path / steps, "--steps", steps)
        assert r.returncode == 0, r.stderr
    t2, m2 = hpmoe.io.load_safetensors(tmp_path / "2" / "checkpoint.safetensors")
    t4, m4 = hpmoe.io.load_safetensors(tmp_path / "4" / "checkpoint.safetensors")
    hpmoe.io.save_safetensors(tmp_path / "s0.safetensors", t4, dict(m4, shard="0 of 2"))
    hpmoe.io.save_safetensors(tmp_path / "s1.safetensors", t2, dict(m2, shard="1 of 2"))
    index = tmp_path / "mixed.index.json"
    index.write_text(json.dumps({"processes": 2, "step": 4, "files": ["s0.safetensors", "s1.safetensors"]}))
    refused(tmp_path, index, "shard s1.safetensors is of step 2, its index of step 4")
    # The same shards in the wrong places, and an index without a step.
    hpmoe.io.save_safetensors(tmp_path / "s1.safetensors", t4, dict(m4, shard="0 of 2"))
    refused(tmp_path, index, "says it is shard 0 of 2, the index lists it as 1 of 2")
    index.write_text(json.dumps({"processes": 2, "files": ["s0.safetensors", "s1.safetensors"]}))
    refused(tmp_path, index, "its index's step None is not an integer")
    # Whole: both shards of step 4 in their places resume.
    hpmoe.io.save_safetensors(tmp_path / "s1.safetensors", t4, dict(m4, shard="1 of 2"))
    index.write_text(json.dumps({"processes": 2, "step": 4, "files": ["s0.safetensors", "s1.safetensors"]}))
    r = train(tmp_path / "whole", "--steps", "6", "--resume", str(index))
    assert r.returncode == 0, r.stderr


def test_non_finite_optimiser_state_is_named(tmp_path):
    r = train(tmp_path / "a", "--steps", "2")
    assert r.returncode == 0, r.stderr
    tensors, meta = hpmoe.io.load_safetensors(tmp_path / "a" / "checkpoint.safetensors")
    name = next(k for k in tensors if k.startswith("opt.exp_avg."))
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] = float("nan")
    hpmoe.io.save_safetensors(tmp_path / "nan.safetensors", tensors, meta)
    refused(tmp_path, tmp_path / "nan.safetensors", f"tensor {name} holds NaN or Inf")
