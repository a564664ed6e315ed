"""Processes of an ep="mpi" job that fail or exit (tests/python/test_mpi_faults.py runs it under mpirun -np 2).

  mpi_faults.py raise     rank 1 raises before its second step while rank 0 enters it: the job must end
  mpi_faults.py exit      rank 1 exits cleanly (sys.exit(0)) before its second step: rank 0 must not wait for it
  mpi_faults.py readme    the README's snippet at module level, objects alive at exit: a clean exit, exit code 0
  mpi_faults.py workers   the processes construct the layer with different workers: one ValueError naming it
  mpi_faults.py path      ... with different mpi_path: the same, not a hang in the path in dispute
"""
import sys

import torch

import hpmoe

mode = sys.argv[1]
cfg = hpmoe.with_fields(hpmoe.preset("mixtral-8x7b"), hidden=48, expert_inter=40, routed_experts=8, top_k=2)

if mode in ("workers", "path"):
    import os
    me = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    kwargs = dict(workers=1 + me) if mode == "workers" else dict(mpi_path="shared" if me == 0 else "network")
    try:
        hpmoe.MoELayer(cfg, ranks=2, ep="mpi", **kwargs)
    except ValueError as e:
        print(f"rank {me}: refused: {e}", flush=True)
        sys.exit(0)
    raise AssertionError("processes constructed with different options were accepted")

torch.manual_seed(0)  # the same replicated parameters (the router) on every process
moe = hpmoe.MoELayer(cfg, ranks=2, workers=1, ep="mpi")
x = torch.randn(16, 48)
y = moe(x)
y.sum().backward()
print(f"rank {moe.rank}: step 1 done", flush=True)
if mode == "readme":
    print(f"rank {moe.rank}: {tuple(y.shape)}", flush=True)  # and exit with the module and its transport alive
elif moe.rank == 1:
    if mode == "raise":
        raise RuntimeError("a user error on rank 1")
    sys.exit(0)
else:
    moe(x).sum().backward()  # rank 1 never comes
    raise AssertionError("rank 0's second step finished without rank 1")
