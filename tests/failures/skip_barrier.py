"""Case 2: a barrier only on rank 0 (rank 1 goes on to its next collective)."""
import lockstep

rt = lockstep.Runtime(accelerator="cpu")
rt.all_reduce(1.0)
if rt.rank == 0:
    rt.barrier()  # rank 1 never comes here
total = rt.all_reduce(2.0, op="sum")
