"""Ray Train's record of a job's checkpoints: each committed lockstep checkpoint is reported to it
(``ray.train.report``), so that Ray's ``Result.checkpoint``, its storage path and its retention
(``CheckpointConfig(num_to_keep=...)``) see it; after Ray restarts the workers, the newest checkpoint
it holds (``ray.train.get_checkpoint()``) is one a resume considers. Ray is imported only here, and
only in a Ray Train worker, where it is already loaded.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from lockstep.env.settings import RAY_CHECKPOINTS
from lockstep.runtime.files import own_name

#: In the run's folder of Ray's storage: each copy's name and the folder lockstep wrote it from.
_SOURCES = "lockstep-sources.json"


class RayRecord:
    """Reports checkpoints to Ray Train and finds the newest one it holds. Every rank calls both
    methods the same number of times: Ray's report is a barrier across its workers."""

    def __init__(self, rank: int, say: Any) -> None:
        self.rank, self.say = rank, say

    def report(self, path: Path, metadata: dict[str, Any]) -> None:
        """Report the committed checkpoint folder ``path`` (rank 0 hands the folder, the others join the
        barrier). A folder inside the run's storage folder is recorded where it is; any other is copied
        there by Ray (the folder lockstep wrote stays). The metadata's numbers (the step; the Trainer's logged
        values) are its metrics."""
        import ray.train
        from ray.train import CheckpointUploadMode

        logged = metadata.get("metrics")
        metrics = {name: value for name, value in {**metadata, **(logged if isinstance(logged, dict) else {})}.items()
                   if isinstance(value, (int, float)) and not isinstance(value, bool)}
        checkpoint = ray.train.Checkpoint.from_directory(str(path)) if self.rank == 0 else None
        in_storage = self._in_storage(path)
        mode = CheckpointUploadMode.NO_UPLOAD if in_storage else CheckpointUploadMode.SYNC
        ray.train.report(metrics, checkpoint=checkpoint, checkpoint_upload_mode=mode,
                         delete_local_checkpoint_after_upload=False, checkpoint_dir_name=Path(path).name)
        if self.rank == 0 and not in_storage and os.environ.get(RAY_CHECKPOINTS) == "as-the-script":
            self._keep_as_the_script(Path(path))

    @staticmethod
    def _keep_as_the_script(path: Path) -> None:
        """Ray's copies of the checkpoints the script has deleted since (its own retention, e.g. the Trainer's
        ``save_top_k``), deleted: Ray's storage holds what the script's folder holds. Each copy's source is
        recorded in the run's folder, so this holds across Ray's restarts of the workers."""
        import ray.train
        from pyarrow.fs import LocalFileSystem

        storage = ray.train.get_context().get_storage()
        if not isinstance(storage.storage_filesystem, LocalFileSystem):
            return  # copies in object storage: Ray's own retention (--keep-checkpoints)
        run = Path(storage.experiment_fs_path)
        record = run / _SOURCES
        try:
            sources = json.loads(record.read_text()) if record.exists() else {}
        except (OSError, ValueError):
            sources = {}  # a damaged record: start it again, deleting nothing
        # read as untrusted: only a copy's own plain name in the run's folder is ever deleted (not "..", a path,
        # a link); an entry of another shape is dropped from the record, deleting nothing
        sources = {name: source for name, source in (sources.items() if isinstance(sources, dict) else ())
                   if own_name(name) and isinstance(source, str)}
        sources[path.name] = str(path.resolve())
        for name, source in list(sources.items()):
            copy = run / name
            if name != path.name and not Path(source).exists():
                if copy.is_dir() and not copy.is_symlink():
                    shutil.rmtree(copy, ignore_errors=True)
                del sources[name]
        record.write_text(json.dumps(sources, indent=1))

    @staticmethod
    def _in_storage(path: Path) -> bool:
        """Whether ``path`` lies in the run's folder of Ray's storage, on a mounted file system."""
        import ray.train
        from pyarrow.fs import LocalFileSystem

        storage = ray.train.get_context().get_storage()
        if not isinstance(storage.storage_filesystem, LocalFileSystem):
            return False
        return Path(path).resolve().is_relative_to(Path(storage.experiment_fs_path).resolve())

    def newest(self) -> Path | None:
        """The folder of the newest checkpoint Ray Train holds for this run (after a restart: the last one
        reported before it), or None. Ray's storage must be a file system the workers mount (a local or
        shared folder); a checkpoint in object storage (s3://, gs://) is not read from there."""
        import ray.train
        from pyarrow.fs import LocalFileSystem

        found = ray.train.get_checkpoint()
        if found is None:
            return None
        if not isinstance(found.filesystem, LocalFileSystem):
            self.say(f"lockstep: Ray's newest checkpoint {found.path} is not on a mounted file system: resuming "
                     "from the checkpoint folder only (give RunConfig(storage_path=...) a shared folder to "
                     "resume from Ray's copies).")
            return None
        return Path(found.path)
