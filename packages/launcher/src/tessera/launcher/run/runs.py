"""One run folder per job, created atomically before anything spawns.

``tessera train`` creates ``train.run_dir/<name>`` with ``mkdir(exist_ok=False)``: a
generated name (``char-gpt-<time>``; ``finetune-<time>`` for ``tessera finetune``) takes a
``-2``, ``-3``... suffix when another job took it in the same second; an explicit
``train.name`` that exists is refused, unless ``train.resume`` lies inside it (resuming into its
own folder). Without a ``train.name``, a resume goes on in the run folder that holds its
checkpoint (``train.resume`` is ``<folder>/checkpoint`` or a ``step-N`` generation in it:
`resumed_folder`), so one run's metrics stay in one folder. The workers find the
folder in ``TESSERA_RUN_FOLDER``; started another way (torchrun directly), rank 0 creates
it the same way and broadcasts its name.

On several nodes each node's ``tessera train`` creates the folder for its own ranks. A node
other than node 0 (``joining``) takes the folder of an explicit ``train.name`` as it finds it;
node 0 takes one that holds nothing but ``logs/`` (another node of the same job made it first,
on a shared disk). Give ``train.name`` on several nodes: a generated name is each node's own.

A job its scheduler starts again (SLURM's requeue: `requeued`) goes on in the folder of its
``train.name``, from the newest committed generation there when it holds one.
"""

from __future__ import annotations

import dataclasses
import os
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from tessera.launcher.checkpoint.generations import committed_checkpoint
from tessera.launcher.config import Config
from tessera.launcher.config.config_io import RUN_FOLDER_ENV

if TYPE_CHECKING:
    import torch

__all__ = [
    "CHECKPOINT_DIR",
    "RunFolderError",
    "create_run_folder",
    "requeued",
    "resumed_folder",
    "run_folder",
]

_NAME_BYTES = 1024
CHECKPOINT_DIR = "checkpoint"  # where a run folder keeps its checkpoint generations


class RunFolderError(ValueError):
    """The run folder cannot be created (one line naming ``train.name`` and the folder)."""


def _resumes_into(config: Config, folder: Path) -> bool:
    resume = config.train.resume
    return bool(resume) and Path(resume).resolve().is_relative_to(folder.resolve())


def resumed_folder(config: Config) -> Path | None:
    """The run folder ``train.resume`` lies in (``<folder>/checkpoint``, or a generation
    ``<folder>/checkpoint/step-N``), where a resume without a ``train.name`` goes on; None when
    there is no resume or its checkpoint lies elsewhere."""
    if not config.train.resume:
        return None
    path = Path(config.train.resume)
    if re.fullmatch(r"step-\d+", path.name):
        path = path.parent
    return path.parent if path.name == CHECKPOINT_DIR else None


def requeued(config: Config) -> Config:
    """``config`` for a job its scheduler started again: with a ``train.name`` whose run folder
    holds a committed generation, ``train.resume`` becomes that folder's checkpoint (the newest
    generation is loaded, whatever ``train.resume`` said when the job was submitted)."""
    if not config.train.name:
        return config
    checkpoints = Path(config.train.run_dir) / config.train.name / CHECKPOINT_DIR
    if committed_checkpoint(checkpoints) is None:
        return config
    return dataclasses.replace(config, train=dataclasses.replace(config.train, resume=str(checkpoints)))


def _made_by_another_node(folder: Path) -> bool:
    """Whether ``folder`` holds only the ``logs/`` another node of this job makes with it (the
    folder may be seen a moment before its ``logs/``)."""
    for _ in range(2):
        held = {p.name for p in folder.iterdir()}
        if held:
            return held == {"logs"}
        time.sleep(0.5)
    return False


def create_run_folder(
    config: Config, *, now: float | None = None, joining: bool = False, again: bool = False
) -> Path:
    """Create this job's run folder and return it (RunFolderError when the name is taken);
    ``joining``: a node other than node 0 of the job; ``again``: a job its scheduler started
    again, which takes the folder of its ``train.name`` as it finds it (module docstring)."""
    root = Path(config.train.run_dir)
    root.mkdir(parents=True, exist_ok=True)
    name = config.train.name
    resumed = resumed_folder(config)
    if not name and resumed is not None:  # the resumed run goes on where it was (metrics appended)
        resumed.mkdir(parents=True, exist_ok=True)
        return resumed
    if name:
        folder = root / name
        if joining:
            (folder / "logs").mkdir(parents=True, exist_ok=True)  # what node 0 recognizes
            return folder
        if again or _resumes_into(config, folder):
            folder.mkdir(exist_ok=True)
            return folder
        try:
            folder.mkdir()
        except FileExistsError:
            if _made_by_another_node(folder):
                return folder
            raise RunFolderError(
                f"train.name={name!r}: {str(folder)!r} already exists (another run's outputs); choose "
                f"another name, or resume into it with train.resume={str(folder / 'checkpoint')!r}"
            ) from None
        return folder
    kind = "finetune" if config.finetune.model else "char-gpt"  # tessera finetune's, or the main job's
    stamp = time.strftime(f"{kind}-%Y%m%d-%H%M%S", time.localtime(time.time() if now is None else now))
    for attempt in range(1, 10_000):
        folder = root / (stamp if attempt == 1 else f"{stamp}-{attempt}")
        try:
            folder.mkdir()
        except FileExistsError:
            continue
        return folder
    raise RunFolderError(f"train.run_dir={str(root)!r}: no free name for {stamp}")


def run_folder(config: Config, device: torch.device, env: Mapping[str, str] | None = None) -> Path:
    """Inside the job, on every rank: the run folder (collective when the launcher made none)."""
    env = os.environ if env is None else env
    given = env.get(RUN_FOLDER_ENV)
    if given:
        return Path(given)
    import torch

    from tessera.comm import broadcast

    payload = torch.zeros(_NAME_BYTES, dtype=torch.uint8)
    if torch.distributed.get_rank() == 0:
        try:
            text = str(create_run_folder(config))
        except RunFolderError as exc:
            text = f"!{exc}"
        data = text.encode()[:_NAME_BYTES]
        payload[: len(data)] = torch.tensor(list(data), dtype=torch.uint8)
    data = bytes(broadcast(payload.to(device), 0).cpu().tolist()).rstrip(b"\0")
    text = data.decode()
    if text.startswith("!"):
        raise RunFolderError(text[1:])
    return Path(text)
