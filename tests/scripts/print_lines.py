"""Each rank prints 50 lines of a length of its own, each `print` in several pieces (as print(a, b, c) writes
them); argv[1] "self": asks for 4 devices in code (self-launch under plain python)."""

import sys

import lockstep

rt = lockstep.Runtime(accelerator="cpu", **({"devices": 4} if sys.argv[1:] == ["self"] else {}))
for i in range(50):
    print(f"rank={rt.rank}", f"line={i:02d}", "x" * (40 + 7 * rt.rank), "end")
