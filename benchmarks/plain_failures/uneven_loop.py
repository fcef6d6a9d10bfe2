import torch
import torch.distributed as dist

dist.init_process_group("gloo")
for step in range(5 if dist.get_rank() == 0 else 4):
    dist.all_reduce(torch.tensor([float(step)]))
dist.barrier()
