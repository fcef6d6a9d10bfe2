import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.ones(3 if dist.get_rank() == 0 else 4)
dist.all_reduce(t)
print(f"rank {dist.get_rank()} got {t.tolist()}", flush=True)
