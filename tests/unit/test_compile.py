"""torch.compile through lockstep: regional, in place, before DDP/FSDP wrap; clean keys; eager's weights."""

from __future__ import annotations

import pytest
import torch

from checks import compile as compile_checks
from checks import trainer as tc
from lockstep.runtime.parallel.compiling import repeated_blocks

pytestmark = pytest.mark.timeout(300)


def test_repeated_blocks_are_the_layers_of_a_module_list_of_one_own_class():
    names = [name for name, _ in repeated_blocks(compile_checks.Net())]
    assert names == ["blocks.0", "blocks.1", "blocks.2"]
    assert repeated_blocks(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))) == []


def test_repeated_blocks_are_found_in_a_module_dict_too():
    """torchtitan's models keep their layers in an nn.ModuleDict: compile, activation checkpointing, FSDP's
    shard groups and the pipeline's cut all find them."""
    from checks import pipeline as pc
    from lockstep.runtime.parallel.fsdp import FSDP
    from lockstep.runtime.parallel.pipeline.stages import split_model

    model = pc.dict_net()
    assert [name for name, _ in repeated_blocks(model)] == [f"layers.{i}" for i in range(4)]
    assert FSDP().blocks(model) == list(model.layers.values())
    assert split_model(model, 2) == [["tok_embeddings", "layers.0", "layers.1"],
                                     ["layers.2", "layers.3", "norm", "output"]]


def test_trainer_compiles_the_module_forward_and_accepts_a_user_compiled_module(tmp_path):
    eager = tc.Classifier()
    tc.quiet_trainer(max_epochs=1).fit(eager, tc.checks.make_data(64), batch_size=16)
    trainer = tc.quiet_trainer(max_epochs=1, checkpoint_dir=tmp_path)
    module = tc.Classifier()
    trainer.fit(torch.compile(module), tc.checks.make_data(64), batch_size=16)
    assert trainer.compiled == [""]  # no repeated blocks: the module's forward, in place
    assert (tc.checks.flat_weights(module) - tc.checks.flat_weights(eager)).abs().max() <= 1e-5
    assert not any("_orig_mod" in key for key in module.state_dict())
    from torch.distributed.checkpoint import FileSystemReader

    (saved,) = [p for p in tmp_path.glob("epoch=*.ckpt")]
    keys = list(FileSystemReader(str(saved)).read_metadata().state_dict_metadata)
    assert any(".net.0.weight" in key for key in keys) and not any("_orig_mod" in key for key in keys), keys
    with pytest.raises(TypeError, match="compile= takes True, False or a dict"):
        tc.quiet_trainer(max_epochs=1, compile="yes").fit(tc.Classifier(), tc.checks.make_data(16), batch_size=16)



def test_fsdp_shards_a_plain_sequential_layer_by_layer_and_a_model_with_layers_by_its_layers():
    from torch import nn

    from lockstep.runtime.parallel.fsdp import FSDP

    inner = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), inner, nn.Linear(4, 2))
    assert FSDP().blocks(model) == [model[0], inner, model[3]]  # the ReLU has no weights; inner stays whole

    class Layered(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([nn.Sequential(nn.Linear(4, 4), nn.ReLU()) for _ in range(2)])
            self.head = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))

    layered = Layered()
    assert FSDP().blocks(layered) == list(layered.layers)  # the head's Sequential is the root's to hold
