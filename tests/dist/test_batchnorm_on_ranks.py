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

