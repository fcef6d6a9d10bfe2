"""Case 1: the script asks for 4 devices; the launcher started 2."""
import lockstep

lockstep.Runtime(accelerator="cpu", devices=4)
