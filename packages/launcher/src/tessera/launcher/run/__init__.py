"""Running a job: the ``tessera`` command (``cli``), the checks on disk before anything spawns
(``preflight``, ``disk_space``), run folders (``runs``), torch.distributed.run attempt after attempt
(``spawn``, ``worker``), a job stopped by a signal (``stopping``), where nodes are (``nodes``,
``fanout``, ``netif``, ``loopback``), and the watchdog, heartbeats and node liveness that end a
hung or orphaned job."""

from typing import TYPE_CHECKING

from tessera.comm import lazy_exports

if TYPE_CHECKING:
    from tessera.launcher.run.runs import CHECKPOINT_DIR, run_folder
    from tessera.launcher.run.stopping import STOP_SIGNALS, StopNote, leave_note

__all__ = ["CHECKPOINT_DIR", "STOP_SIGNALS", "StopNote", "leave_note", "run_folder"]

if not TYPE_CHECKING:  # imported on first use (PEP 562), so the package stays light to import
    __getattr__, __dir__ = lazy_exports(__name__, ("runs", "stopping"))
