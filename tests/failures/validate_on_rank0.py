"""Case 11: validate() called on rank 0 only, after fit: rank 1 ends its script while rank 0 waits."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # tests/
from checks import dist as checks  # noqa: E402
from checks import trainer as tc  # noqa: E402

trainer = tc.quiet_trainer(max_epochs=1)
module = tc.Classifier()
trainer.fit(module, checks.make_data(64), batch_size=16)
if trainer.runtime.rank == 0:
    trainer.validate(module, checks.make_data(32), batch_size=8)  # rank 1 never comes here
