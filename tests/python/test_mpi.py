"""hpmoe.MoELayer(ep="mpi") under mpirun -np 2 (tests/python/mpi_module.py): bit for bit the in-process layer."""
import os
import shutil
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.parametrize("executor", ["interleaved", "serialized"])
def test_two_processes_are_the_in_process_layer_bit_for_bit(tmp_path, executor):
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        pytest.skip("no mpirun (Debian: openmpi-bin)")
    (tmp_path / "ompi").mkdir()
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_orte_tmpdir_base=str(tmp_path / "ompi"))  # apart from other mpiruns on the machine
    r = subprocess.run([mpirun, "-np", "2", "--oversubscribe", sys.executable, os.path.join(HERE, "mpi_module.py"),
                        executor], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    for rank in (0, 1):
        assert f"rank {rank}: {executor}: 3 steps bit-identical" in r.stdout, r.stdout + r.stderr
