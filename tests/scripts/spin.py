"""Workers that keep synchronising until stopped; each writes its pid; rank 1 can raise on request.

With SPIN_DEVICES=N in the environment the script asks for N devices itself: started with plain
python, it becomes their agent (self-launch). The legacy launcher's ``--local-rank=N`` is left out of the
arguments (lockstep reads it)."""

import os
import sys
import time

import lockstep

rt = lockstep.Runtime(accelerator="cpu", timeout=60, devices=int(os.environ.get("SPIN_DEVICES", 0)) or "auto")
sys.argv = [arg for arg in sys.argv if not arg.startswith(("--local-rank", "--local_rank"))]
with open(os.path.join(sys.argv[1], f"{rt.rank}.tmp"), "w") as handle:
    handle.write(str(os.getpid()))
# Renamed once written: a test that sees N.pid never reads it half-written.
os.replace(os.path.join(sys.argv[1], f"{rt.rank}.tmp"), os.path.join(sys.argv[1], f"{rt.rank}.pid"))
deadline = time.monotonic() + float(os.environ.get("SPIN_SECONDS", 60))
step = 0
# The ranks agree on when to stop (any rank past its deadline): each reads its own clock, and a rank
# that left the loop alone would leave the others waiting in a collective for it.
while not rt.all_reduce(float(time.monotonic() >= deadline), "max"):
    if len(sys.argv) > 2 and sys.argv[2] == "raise" and rt.rank == 1 and step == 5:
        raise RuntimeError("rank one gives up at step 5")
    time.sleep(0.05)
    step += 1
