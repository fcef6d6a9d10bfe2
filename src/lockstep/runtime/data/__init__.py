"""Data: the global order of the samples, this rank's sampler over it, streams, and the loader with
its batch observer (``rt.loader``, ``rt.eval_loader``).

A batch's path from the dataset to this rank's device lives here. It uses ``faults`` (the loader
reports its position to the watchdog) and the shared foundations; it never imports ``checkpoint``,
``launch`` or the facade (import-linter contracts in pyproject.toml).
"""
