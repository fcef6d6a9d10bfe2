"""Pipeline parallel (``lockstep.Parallel(pp=...)``): the model cut into stages by layer, each pipeline rank
holding its stages, and one of torch's schedules running a step's micro-batches through them
(``torch.distributed.pipelining``).

- ``stages``: the cut (``Skipped`` stands in for another stage's modules, so names stay the whole
  model's), the schedules by name and the stages each pipeline rank holds;
- ``schedule``: ``Pipeline``, torch's schedule over this rank's stages, each micro-batch's loss and
  weight, and a forward through every stage for evaluation;
- ``staged``: ``StagedModel``, the Runtime's model kind under pipeline parallel (``parallel/models.py``
  has the order it runs in and the whole-model kind), and ``PipelinedModule``, what ``rt.setup`` returns.

Imports only ``parallel``'s foundations (precision, wrappers, the mesh's types) and ``comm``.
"""
