"""A multi-node job in which node FAILING_NODE fails at STAGE: import, init, collective or training."""

import os
import sys
import time

stage, failing = sys.argv[1], int(sys.argv[2])
here = int(os.environ["GROUP_RANK"]) == failing
if here and stage == "import":
    raise RuntimeError("node fails before creating the Runtime")
if stage == "init":
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # a wrong setting: the nodes cannot reach each other's Gloo

import torch  # noqa: E402

import lockstep  # noqa: E402

rt = lockstep.Runtime(accelerator="cpu")
if here and stage == "collective":
    raise RuntimeError("node fails before the first collective")
for step in range(200):
    if here and stage == "training" and step == 5:
        raise RuntimeError("node fails at training step 5")
    rt.all_reduce(torch.ones(4))
    time.sleep(0.05)
