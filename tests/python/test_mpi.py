"""hpmoe.MoELayer(ep="mpi") under mpirun -np 2 (tests/python/mpi_module.py): bit for bit the in-process layer."""
import os
import shutil
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def mpi_env(tmp_path):
    """mpirun as root, its session directories apart from other mpiruns on the machine."""
    (tmp_path / "ompi").mkdir(exist_ok=True)
    return dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                OMPI_MCA_orte_tmpdir_base=str(tmp_path / "ompi"))


@pytest.mark.parametrize("executor,lend", [("interleaved", None), ("serialized", None), ("interleaved", "4"),
                                           ("interleaved", "online")])
def test_two_processes_are_the_in_process_layer_bit_for_bit(tmp_path, executor, lend):
    """With lend, hot experts' weights lent across the processes every step, through three training steps."""
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        pytest.skip("no mpirun (Debian: openmpi-bin)")
    env = mpi_env(tmp_path)
    r = subprocess.run([mpirun, "-np", "2", "--oversubscribe", sys.executable, os.path.join(HERE, "mpi_module.py"),
                        executor] + ([lend] if lend else []), capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    for rank in (0, 1):
        assert f"rank {rank}: {executor}: 3 steps bit-identical" in r.stdout, r.stdout + r.stderr


def test_training_example_two_processes_are_one_bit_for_bit(tmp_path):
    """examples/train_moe_lm.py under mpirun -np 2 (experts sharded by hpmoe, the dense parts data-parallel over
    gloo): the loss curve is bit for bit the one-process run's with 2 in-process ranks; each process writes its
    shard of the checkpoint and rank 0 the index; the sharded run resumes bit for bit (--check-resume), and
    its checkpoint resumes on one process continuing the same curve; --ranks other than the process count
    is refused with exit code 2."""
    import json
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        pytest.skip("no mpirun (Debian: openmpi-bin)")
    example = os.path.join(os.path.dirname(os.path.dirname(HERE)), "examples", "train_moe_lm.py")
    tiny = ["--layers", "1", "--d", "32", "--heads", "2", "--inter", "32", "--experts", "4", "--seq", "16", "--batch", "4",
            "--threads", "1"]
    env = mpi_env(tmp_path)

    def run(cmd, out, *extra):
        r = subprocess.run(cmd + [sys.executable, example] + tiny + ["--out", str(tmp_path / out)] + list(extra),
                           capture_output=True, text=True, env=env, timeout=600)
        return r, (json.load(open(tmp_path / out / "metrics.json")) if r.returncode == 0 else None)

    two = [mpirun, "-np", "2", "--oversubscribe"]
    r, sharded = run(two, "two", "--steps", "10", "--check-resume")
    assert r.returncode == 0, r.stdout + r.stderr
    assert sharded["processes"] == 2 and sharded["resume_bit_identical"]
    index = json.load(open(tmp_path / "two" / "checkpoint.index.json"))
    assert index["processes"] == 2 and index["step"] == 10
    assert all((tmp_path / "two" / f).stat().st_size > 0 for f in index["files"])
    r, one = run([], "one", "--steps", "10", "--no-twin")
    assert r.returncode == 0, r.stdout + r.stderr
    assert one["hpmoe"]["loss"] == sharded["hpmoe"]["loss"]
    r, resumed = run([], "resumed", "--steps", "14", "--no-twin", "--resume", str(tmp_path / "two" / "checkpoint.index.json"))
    assert r.returncode == 0, r.stdout + r.stderr
    r, straight = run([], "straight", "--steps", "14", "--no-twin")
    assert resumed["hpmoe"]["loss"] == straight["hpmoe"]["loss"][10:]
    r, _ = run(two, "bad", "--steps", "2", "--ranks", "4")
    assert r.returncode != 0 and "run one per expert-parallel rank (--ranks 2)" in r.stderr, r.stderr
