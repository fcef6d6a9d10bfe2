"""torch.compile through lockstep: regional, in place, before DDP/FSDP wrap; clean keys; eager's weights."""

from __future__ import annotations

import pytest
import torch

import lockstep
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
    assert split_model(model, 2) == [
        ["tok_embeddings", "layers.0", "layers.1"],
        ["layers.2", "layers.3", "norm", "output"],
    ]


class Bottleneck(torch.nn.Module):
    """A ResNet block: the first of a stage changes the width and downsamples the shortcut."""

    def __init__(self, width_in: int, width: int) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(width_in, width, 3, padding=1)
        self.shortcut = torch.nn.Conv2d(width_in, width, 1) if width_in != width else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.conv(x)) + (x if self.shortcut is None else self.shortcut(x))


class ResNetLike(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.stages = torch.nn.ModuleList(
            torch.nn.Sequential(Bottleneck(w_in, w), Bottleneck(w, w), Bottleneck(w, w))
            for w_in, w in ((4, 4), (4, 8), (8, 16))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for stage in self.stages:
            x = stage(x)
        return x.mean()


def test_blocks_of_many_layouts_are_compiled_with_the_model_whole_and_blocks_of_few_by_region():
    """Compiled by region, a ResNet's blocks (five layouts here: widths, a shortcut) compile the block's code once
    per layout, for training and again for evaluation, against torch's limit of 8, with the code between them
    eager; so such a model is compiled whole, in one graph, as is one whose blocks each have a layout of their
    own. Blocks of one layout (a transformer's layers), or of two (dense first layers, then mixtures of
    experts), are compiled by region: a graph per layout."""
    from torch._dynamo.utils import counters

    from lockstep.runtime.parallel.compiling import compile_in_place

    torch._dynamo.reset()
    counters.clear()
    model = ResNetLike()
    assert len(repeated_blocks(model)) == 9  # still the blocks of activation checkpointing and the pipeline's cut
    expected = model(torch.ones(1, 3, 6, 6))
    assert compile_in_place(model, {"backend": "eager"}) == [""]
    assert torch.equal(model(torch.ones(1, 3, 6, 6)), expected)
    assert counters["stats"]["unique_graphs"] == 1

    for dense_first, graphs in ((0, 1), (1, 2)):
        torch._dynamo.reset()
        counters.clear()
        net = compile_checks.Net(depth=4)
        for block in list(net.blocks)[:dense_first]:  # a layout of its own: another MLP width
            block.up, block.down = torch.nn.Linear(16, 48), torch.nn.Linear(48, 16)
        assert compile_in_place(net, {"backend": "eager"}) == [f"blocks.{i}" for i in range(4)]
        net(torch.ones(2, 8))
        assert counters["stats"]["unique_graphs"] == graphs  # one graph per layout serves the four layers

    net = compile_checks.Net(depth=4)  # 4 blocks in 4 layouts: a graph each would reuse nothing
    for index, block in enumerate(list(net.blocks)[:3]):
        width = 24 + 8 * index
        block.up, block.down = torch.nn.Linear(16, width), torch.nn.Linear(width, 16)
    assert compile_in_place(net, {"backend": "eager"}) == [""]

    torch._dynamo.reset()
    counters.clear()
    holder = torch.nn.Module()  # no forward of its own: compiled whole is each child
    holder.net, holder.head = ResNetLike(), torch.nn.Linear(2, 2)
    assert compile_in_place(holder, {"backend": "eager", "regional": False}) == ["net", "head"]
    holder.net(torch.ones(1, 3, 6, 6))
    assert counters["stats"]["unique_graphs"] == 1


def test_a_trainer_module_without_a_forward_has_its_model_compiled_whole_where_the_steps_call_it():
    """A Trainer's module whose training_step calls ``self.net`` (no forward of its own): compiling the module
    whole would compile a forward that nothing calls, and the model would run eagerly; its child is compiled."""
    from torch._dynamo.utils import counters

    class Vision(lockstep.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = ResNetLike()

        def training_step(self, batch, batch_idx):
            return self.net(batch[0])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch._dynamo.reset()
    counters.clear()
    trainer = tc.quiet_trainer(max_epochs=1, compile={"backend": "eager"})
    trainer.fit(Vision(), torch.utils.data.TensorDataset(torch.ones(8, 3, 6, 6)), batch_size=4)
    assert trainer.compiled == ["net"]
    assert counters["stats"]["unique_graphs"] >= 1  # the model ran compiled


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
