"""A Trainer run of a tiny Llama under whatever ``lockstep run --parallel`` gives (context parallel), token-
averaged (num_items), checkpointed every 2 steps; rank 1 SIGKILLs itself at a chosen step. Rank 0 saves the
final weights and the predictions (logits of every position) of 13 rows.
argv: CHECKPOINT_DIR OUT KILL_AT [no-checkpoints]"""

import os
import signal
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
import lockstep  # noqa: E402
from checks import context as cc  # noqa: E402
from checks import mesh as mc  # noqa: E402
from checks import trainer as tc  # noqa: E402

checkpoint_dir, out, kill_at = sys.argv[1], sys.argv[2], int(sys.argv[3])
saves = sys.argv[4:] != ["no-checkpoints"]  # lockstep verify: its two runs must not resume from each other's
first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"


class KillAt(lockstep.Callback):
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == kill_at and trainer.runtime.rank == 1 and first_attempt:
            os.kill(os.getpid(), signal.SIGKILL)


class Llama(lockstep.Module):
    def __init__(self) -> None:
        super().__init__()
        self.llama = cc.tiny_model("llama")

    def training_step(self, batch, batch_idx):
        return {"loss": self.llama(**mc.model_inputs(batch)).loss, "num_items": cc.valid_tokens(batch)}

    def configure_optimizers(self):
        return cc.optimizer_for(self, cc.LR)

    def predict_step(self, batch, batch_idx):
        return self.llama(**mc.model_inputs(batch)).logits


module = Llama()
trainer = tc.quiet_trainer(max_epochs=2, strategy="fsdp", checkpoint_dir=checkpoint_dir, resume="auto",
                           callbacks=[lockstep.ModelCheckpoint(every_n_steps=2, every_n_epochs=None, save_top_k=1)]
                           * saves + [KillAt()])
trainer.fit(module, cc.Rows(40), batch_size=8)
predictions = trainer.predict(module, cc.Rows(13), batch_size=4)
weights = cc.hc.flat(module.llama)  # FSDP's shards gathered: every rank takes part
if trainer.is_global_zero:
    torch.save({"weights": weights, "steps": trainer.global_step, "predictions": predictions,
                "parallel": os.environ.get("LOCKSTEP_PARALLEL")}, out)
