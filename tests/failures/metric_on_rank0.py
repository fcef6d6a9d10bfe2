"""Case 2b: a metric synced on rank 0 only (caught at once in debug mode)."""
import lockstep

rt = lockstep.Runtime(accelerator="cpu")
if rt.rank == 0:
    accuracy = rt.all_reduce(0.9)  # rank 1 skips this and goes to the barrier
rt.barrier()
