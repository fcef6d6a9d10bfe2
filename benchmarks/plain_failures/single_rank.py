import torch.distributed as dist

dist.init_process_group("gloo")  # one rank of two, started alone: RANK, WORLD_SIZE, MASTER_* from the caller
