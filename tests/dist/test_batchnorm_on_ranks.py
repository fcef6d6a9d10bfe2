"""What the Trainer writes: logs, profiler reports, checkpoints, scheduler steps, throughput advice."""

from __future__ import annotations

import pytest
import torch

from checks import trainer as tc

pytestmark = pytest.mark.timeout(120)


def test_batchnorm_predictions_and_metrics_on_2_processes_are_the_saved_models(tmp_path):
    """Each rank trains its BatchNorm statistics on its own rows; evaluation, predict and the
    checkpoint all use rank 0's, so both ranks' rows equal the saved model's outputs in one process."""
    from lockstep.testing import run_ranks

    results = run_ranks(tc.batchnorm_predictions, 2, str(tmp_path / "ckpt"))
    x, y = tc.checks.make_data(40, seed=1).tensors
    saved = tc.batchnorm_model_from(results[0]["checkpoint"])
    with torch.no_grad():
        expected = saved(x)
        loss = torch.nn.functional.cross_entropy(expected, y).item()
    for result in results:
        assert torch.allclose(result["rows"], expected, atol=1e-6, rtol=0)
        assert abs(result["val_loss"] - loss) < 1e-6



def test_evaluating_batchnorm_trained_on_several_ranks_without_sync_buffers_is_said_once():
    """Each rank's running statistics moved with its own rows: model.eval() says so once (naming
    rt.sync_buffers), and says nothing once the buffers were synchronised; on one process, nothing."""
    from lockstep.testing import run_ranks

    assert run_ranks(tc.checks.batchnorm_eval_warnings, 2) == [{"unsynced": 1, "synced": 0}] * 2
    assert run_ranks(tc.checks.batchnorm_eval_warnings, 1) == [{"unsynced": 0, "synced": 0}]
