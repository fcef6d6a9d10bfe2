"""Export a checkpoint of a Hugging Face ``transformers`` model as a folder that
``from_pretrained`` loads: ``config.json`` and sharded safetensors.

``rt.save`` records, for each saved model that is or holds a ``PreTrainedModel``, where it sits
in the model (``prefix``), its class name and its config (``hf_models`` in ``lockstep.json``).
The export joins the shards (``model_weights``: any FSDP or 2-D checkpoint), builds the class
from the config, loads the weights strictly and calls ``save_pretrained``. The class is looked
up by name in ``transformers`` only, never imported from a name the file gives.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from torch import nn

from lockstep.errors import CheckpointError
from lockstep.runtime.checkpoint.consolidate import model_weights
from lockstep.runtime.checkpoint.format import read_metadata


def describe(model: nn.Module) -> dict[str, Any] | None:
    """The outermost ``PreTrainedModel`` in ``model``: its place, class name and config; None when
    there is none (or ``transformers`` was never imported, so there cannot be one)."""
    if "transformers" not in sys.modules:
        return None
    from transformers import PreTrainedModel

    for name, module in model.named_modules():
        if isinstance(module, PreTrainedModel):
            # FSDP makes a subclass (FSDPLlamaForCausalLM): the class is the first of transformers' own
            cls = next(c for c in type(module).__mro__ if c.__module__.startswith("transformers."))
            return {"prefix": name, "class": cls.__name__, "config": module.config.to_dict()}
    return None


def export_hf(folder: Path, out: Path, part: str | None = None, max_shard_size: str = "5GB") -> str:
    """Write ``out`` (config.json, safetensors) from the checkpoint ``folder``; returns the class name."""
    described = read_metadata(folder).get("hf_models") or {}
    if not isinstance(described, dict) or not described:
        raise CheckpointError(f"{folder}: holds no Hugging Face model (its lockstep.json names none): export "
                              "needs a checkpoint of a transformers PreTrainedModel, saved by rt.save or the Trainer.")
    if part is None:
        if len(described) != 1:
            raise CheckpointError(f"{folder}: holds the Hugging Face models {sorted(described)}: choose one with "
                                  "--part.")
        part = next(iter(described))
    info = described.get(part)
    if not isinstance(info, dict):
        raise CheckpointError(f"{folder}: holds no Hugging Face model {part!r}; it holds {sorted(described)}.")
    try:
        import transformers
    except ImportError:
        raise CheckpointError("exporting to Hugging Face needs transformers: pip install 'lockstep[hf]'.") from None
    cls = getattr(transformers, str(info.get("class")), None)
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        raise CheckpointError(f"{folder}: names the model class {info.get('class')!r}, which is no PreTrainedModel "
                              f"of transformers {transformers.__version__}.")
    prefix = f"{info['prefix']}." if info.get("prefix") else ""
    weights = {name[len(prefix):]: tensor for name, tensor in model_weights(folder, part).items()
               if name.startswith(prefix)}
    config_class = cls.config_class or transformers.PretrainedConfig
    model = cls(config_class.from_dict(dict(info.get("config") or {})))
    expected = set(model.state_dict())
    missing, unexpected = sorted(expected - set(weights)), sorted(set(weights) - expected)
    if missing or unexpected:
        raise CheckpointError(f"{folder}: its weights do not fit {cls.__name__} (missing {missing[:5]}, unexpected "
                              f"{unexpected[:5]}).")
    model.load_state_dict(weights, strict=True)
    model.save_pretrained(out, max_shard_size=max_shard_size)
    return cls.__name__
