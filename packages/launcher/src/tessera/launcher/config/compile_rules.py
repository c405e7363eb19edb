"""What ``train.compile`` cannot be combined with, checked with the configuration before
anything spawns (torch-free: the launcher refuses before it imports torch; the compiling
itself is ``tessera.launcher.train.compiling``)."""

from __future__ import annotations

from tessera.pipeline import SCHEDULES, ActionKind, build_schedule, schedule_spec

__all__ = ["compile_problems"]


def compile_problems(pp: int, schedule: str, microbatches: int, virtual_stages: int) -> list[str]:
    """Why ``train.compile`` cannot run with these degrees and this schedule, one line each
    (empty when it can): a pipeline schedule that splits the backward is refused."""
    if pp == 1 or schedule not in SCHEDULES:  # an unknown schedule is reported on its own
        return []
    if schedule_spec(schedule).check(pp, microbatches, virtual_stages):
        return []  # so are its rules
    built = build_schedule(schedule, pp, microbatches, virtual_stages)
    if any(a.kind is ActionKind.W for actions in built.actions for a in actions):
        return [
            f"train.compile=true with parallel.schedule={schedule!r} is not built: it splits the "
            "backward (input and weight gradients apart), which a compiled layer's backward cannot "
            "do; pick a schedule that does not split (1f1b, interleaved-1f1b, ...) or train.compile=false"
        ]
    return []
