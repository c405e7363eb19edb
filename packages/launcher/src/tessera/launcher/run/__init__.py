"""Running a job: the ``tessera`` command (``cli``), the checks on disk before anything spawns
(``preflight``, ``disk_space``), run folders (``runs``), torch.distributed.run attempt after attempt
(``spawn``, ``worker``), where nodes are (``nodes``, ``fanout``, ``netif``, ``loopback``), and the
watchdog, heartbeats and node liveness that end a hung or orphaned job."""
