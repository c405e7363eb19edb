"""The planner: predict per-rank memory and step time of every configuration the launcher
accepts for a model on a cluster, and rank them (``tessera plan``).

Pure and fast (no torch): `Cluster` (hardware as data, presets), `ModelShape` (the GPT's
sizes), `estimate` (one configuration), `search` (all of them); `plan.auto.auto_config` is
what ``parallel.auto = true`` runs. ``tessera plan --calibrate``
(`tessera.launcher.plan.calibrate`, which needs torch) measures this machine.
"""

from tessera.launcher.plan.cluster import PRESETS, Cluster, cluster_to_toml, load_cluster
from tessera.launcher.plan.estimate import Estimate, StepTime, estimate
from tessera.launcher.plan.memory import MemoryEstimate, model_state_bytes
from tessera.launcher.plan.model import ModelShape, TPShape
from tessera.launcher.plan.search import Candidate, SearchResult, search

__all__ = [
    "PRESETS",
    "Candidate",
    "Cluster",
    "Estimate",
    "MemoryEstimate",
    "ModelShape",
    "SearchResult",
    "StepTime",
    "TPShape",
    "cluster_to_toml",
    "estimate",
    "load_cluster",
    "model_state_bytes",
    "search",
]
