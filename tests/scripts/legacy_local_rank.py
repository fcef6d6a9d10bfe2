"""A script written for `python -m torch.distributed.launch`: it parses --local-rank itself."""

import argparse

import torch

import lockstep

parser = argparse.ArgumentParser()
parser.add_argument("--local-rank", "--local_rank", type=int, required=True)
parser.add_argument("out")
args = parser.parse_args()
rt = lockstep.Runtime(accelerator="cpu")
assert rt.local_rank == args.local_rank, (rt.local_rank, args.local_rank)
total = rt.all_reduce(torch.tensor([float(rt.rank + 1)]), op="sum")
if rt.is_global_zero:
    torch.save({"total": float(total), "launcher": rt.env.launcher, "world_size": rt.world_size}, args.out)
