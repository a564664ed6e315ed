"""ep="mpi" processes that fail or exit (tests/python/mpi_faults.py under mpirun -np 2): an error or exit on any
process ends the job within seconds with a line naming the process and the cause; a clean exit is clean, whatever
Python objects are alive; processes started with different options get one error naming the option."""
import os
import shutil
import subprocess
import sys
import time

import pytest

from test_mpi import mpi_env

HERE = os.path.dirname(os.path.abspath(__file__))


def launch(tmp_path, mode, timeout=120):
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        pytest.skip("no mpirun (Debian: openmpi-bin)")
    start = time.monotonic()
    r = subprocess.run([mpirun, "-np", "2", "--oversubscribe", sys.executable, os.path.join(HERE, "mpi_faults.py"), mode],
                       capture_output=True, text=True, env=mpi_env(tmp_path), timeout=timeout)
    return r, time.monotonic() - start


def test_an_exception_on_one_process_ends_the_job(tmp_path):
    r, took = launch(tmp_path, "raise")
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    assert "error: rank 1: RuntimeError: a user error on rank 1" in out, out
    assert "rank 0's second step finished" not in out, out
    assert took < 60, f"the job took {took:.0f} s to end"


def test_a_process_that_exits_does_not_leave_its_peer_waiting(tmp_path):
    r, took = launch(tmp_path, "exit")
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    assert "error: rank 0:" in out and "rank 1 has left the job" in out, out
    assert took < 60, f"the job took {took:.0f} s to end"


def test_the_readme_snippet_exits_cleanly_with_its_objects_alive(tmp_path):
    r, _ = launch(tmp_path, "readme")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "rank 0: (16, 48)" in r.stdout and "rank 1: (16, 48)" in r.stdout, out
    assert "Segmentation fault" not in out and "signal" not in out.lower(), out


@pytest.mark.parametrize("mode,option", [("workers", "MoELayer(workers=...)"), ("path", "--mpi-path (module: mpi_path)")])
def test_processes_with_different_options_are_told_which(tmp_path, mode, option):
    r, took = launch(tmp_path, mode)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    for rank in (0, 1):
        assert f"rank {rank}: refused: rank 1 was started with another {option} than rank 0" in r.stdout, out
    assert took < 60
