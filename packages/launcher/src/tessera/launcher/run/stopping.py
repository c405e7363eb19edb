"""A job stopped by a signal: its ranks save, the launcher says where (torch-free).

Three signals stop a job (`STOP_SIGNALS`): SIGINT (Ctrl-C), SIGTERM (a scheduler's preemption,
``scancel``, ``scontrol requeue``) and SIGUSR1 (the scheduler's warning before the time limit:
SLURM's ``--signal=USR1@SECONDS``). One reaches ``tessera``; torch's elastic agent passes the same
signal to every rank (``AGENT_SIGNALS``: torch's own list and SIGUSR1) and gives the ranks
``STOP_GRACE_S`` to exit before it kills them. The main job (``job.stop``) takes the signal as a
request: at the next step boundary its ranks agree on it (one all-reduce a step), save a
checkpoint generation, and each writes a `StopNote` into the launcher's heartbeat folder and
exits 0. The launcher then says in one line where the generation is and how to resume, and exits
``128 + the signal's number`` (130 for SIGINT, 143 for SIGTERM, 138 for SIGUSR1): no traceback,
no restart. A rank signalled alone (a scheduler that signals every process) stops the whole job
the same way. A second Ctrl-C ends every rank at once (a save cut short is a torn generation: the
one before it stays).
"""

from __future__ import annotations

import json
import os
import signal
from dataclasses import asdict, dataclass
from pathlib import Path

from tessera.launcher.checkpoint.generations import committed_checkpoint
from tessera.launcher.config.config_io import HEARTBEAT_ENV
from tessera.launcher.run.runs import CHECKPOINT_DIR

__all__ = [
    "AGENT_SIGNALS",
    "NOTE",
    "STOP_GRACE_S",
    "STOP_SIGNALS",
    "StopNote",
    "exit_code",
    "leave_note",
    "read_note",
    "stop_line",
    "write_note",
]

NOTE = "stopped.json"
STOP_GRACE_S = 30  # torch's elastic agent: how long the ranks have after the signal
# Ctrl-C, preemption, and the scheduler's warning before the time limit (SLURM --signal=USR1@N)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
# the signals torch's elastic agent turns into a shutdown that passes them on to the ranks
# (torchrun's --signals-to-handle): its default list, and SIGUSR1, which would otherwise end the
# launcher at once and leave its ranks unsaved
AGENT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"


@dataclass(frozen=True, slots=True)
class StopNote:
    """What a rank says when it stopped on a signal: which, after which step, and what it saved."""

    signal: str  # its name: "SIGINT", "SIGTERM", "SIGUSR1"
    step: int
    generation: str  # the committed generation of ``step``
    checkpoint: str  # what ``train.resume`` names to go on from it


def write_note(directory: Path, note: StopNote) -> None:
    """Replace ``directory/stopped.json`` atomically with ``note`` (every rank writes the same)."""
    tmp = directory / f".{NOTE}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(asdict(note)))
    os.replace(tmp, directory / NOTE)


def leave_note(note: StopNote) -> None:
    """In a rank: leave ``note`` in the launcher's heartbeat folder (nothing when no ``tessera``
    launched it, under plain torchrun)."""
    folder = os.environ.get(HEARTBEAT_ENV)
    if folder:
        write_note(Path(folder), note)


def read_note(directory: Path) -> StopNote | None:
    """The note of a stopped job, or None (no rank stopped on a signal)."""
    try:
        return StopNote(**json.loads((directory / NOTE).read_text()))
    except (OSError, ValueError, TypeError):
        return None


def exit_code(signum: int) -> int:
    """The command's exit code after ``signum``: 128 + its number, as a shell reports it."""
    return 128 + signum


def stop_line(signum: int, note: StopNote | None, run: Path | None) -> str:
    """The launcher's one line: where the ranks saved, else the newest generation of the run
    folder ``run`` (None: a script's job, whose checkpoints the launcher does not know)."""
    name = signal.Signals(signum).name
    if note is not None:
        return (
            f"stopped by {name} after step {note.step}: saved {note.generation}; resume with --set "
            f"train.resume={note.checkpoint}"
        )
    if run is None:
        return f"interrupted by {name}; every rank was stopped"
    newest = committed_checkpoint(run / CHECKPOINT_DIR)
    if newest is None:
        return f"stopped by {name} before a checkpoint could be saved; {run} holds none to resume from"
    return (
        f"stopped by {name} before the ranks could save; the newest checkpoint is {newest}: resume with "
        f"--set train.resume={run / CHECKPOINT_DIR}"
    )
