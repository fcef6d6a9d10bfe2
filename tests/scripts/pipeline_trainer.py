"""The Trainer on a small Llama, checkpoints every 2 steps, resume="auto"; rank 1 SIGKILLs itself at a chosen
step. argv: CHECKPOINT_DIR OUT STRATEGY (pp2 | pp2tp2 | fsdp | single) KILL_AT (-1: never)."""

import os
import signal
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
import lockstep  # noqa: E402
from checks import mesh as mc  # noqa: E402
from checks import pipeline as pc  # noqa: E402

checkpoint_dir, out, name, kill_at = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
from checks.dist import layout  # noqa: E402

strategy = {"pp2": lockstep.Parallel(pp=2), "pp2tp2": lockstep.Parallel(pp=2, tp=2), "fsdp": "fsdp",
            "single": "single"}[name]


class KillAt(lockstep.Callback):
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == kill_at and trainer.runtime.rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)


module = pc.LlamaModule()
trainer = lockstep.Trainer(accelerator="cpu", **layout(strategy), max_epochs=2, seed=0, gradient_clip_val=0.5,
                           enable_progress_bar=False, enable_throughput_monitor=False, loggers=(),
                           checkpoint_dir=checkpoint_dir, resume="auto", callbacks=[
                               lockstep.ModelCheckpoint(every_n_steps=2, every_n_epochs=None, save_top_k=2),
                               KillAt()])
trainer.fit(module, mc.Rows(32), batch_size=8, loader_options={"collate_fn": pc.collate, "num_workers": 0})
named = ((n.removeprefix("model."), p) for n, p in module.named_parameters())
weights = pc.whole_weights(trainer.runtime, named)
if trainer.is_global_zero:
    torch.save({"weights": weights, "steps": trainer.global_step}, out)
