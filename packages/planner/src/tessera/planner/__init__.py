"""tessera.planner: predict per-rank memory and step time of every layout of a job on a
cluster, and rank them.

Pure and fast (no torch): `Cluster` (hardware as data, presets), `ModelShape` (a GPT's
sizes and its global batch), `Job` (the model, precision and optimizer), `Layout` (degrees,
tensor-parallel mode, schedule, ZeRO stage, recomputation), `estimate` (one layout),
`search` (all of them, each kept only if the caller's ``validate`` accepts it). The
calibrator (`tessera.planner.calibrate`, which needs torch and the ``calibrate`` extra)
measures this machine as a `Cluster`.
"""

from tessera.planner.cluster import PRESETS, Cluster, cluster_to_toml, load_cluster, resolve_cluster
from tessera.planner.estimate import Estimate, StepTime, estimate
from tessera.planner.layout import Job, Layout, check
from tessera.planner.memory import MemoryEstimate, model_state_bytes
from tessera.planner.model import ModelShape, TPShape
from tessera.planner.search import Candidate, SearchResult, Validate, search

__version__ = "0.1.0"

__all__ = [
    "PRESETS",
    "Candidate",
    "Cluster",
    "Estimate",
    "Job",
    "Layout",
    "MemoryEstimate",
    "ModelShape",
    "SearchResult",
    "StepTime",
    "TPShape",
    "Validate",
    "check",
    "cluster_to_toml",
    "estimate",
    "load_cluster",
    "model_state_bytes",
    "resolve_cluster",
    "search",
]
