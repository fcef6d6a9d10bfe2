"""Run on every rank of a multi-node job: a 4-rank all-reduce and a short training run."""

import os
import socket
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
import lockstep  # noqa: E402
from checks import dist as checks  # noqa: E402

rt = lockstep.Runtime(accelerator="cpu", seed=0)
ranks = rt.all_gather((rt.rank, rt.node_rank, rt.local_rank))
total = rt.all_reduce(torch.tensor([float(rt.rank + 1)]), op="sum")
weights = checks.train_lockstep(rt, checks.make_data(103), 16, epochs=2, shuffle=True)
torch.save({"ranks": ranks, "total": float(total), "weights": weights, "world_size": rt.world_size,
            "num_nodes": rt.num_nodes, "host": socket.gethostname()},
           os.path.join(sys.argv[1], f"rank{rt.rank}.pt"))
