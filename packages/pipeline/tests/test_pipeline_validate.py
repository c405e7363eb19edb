"""Validator: broken schedules are rejected with a message that names the problem."""

from __future__ import annotations

import dataclasses
import re

import pytest

from tessera.pipeline import (
    Action,
    ActionKind,
    P2PModel,
    Schedule,
    gpipe,
    one_f_one_b,
    simulate,
    validate,
    zero_bubble_h1,
)

K = ActionKind


def with_rank(sch: Schedule, rank: int, acts: list[Action]) -> Schedule:
    rows = list(sch.actions)
    rows[rank] = tuple(acts)
    return dataclasses.replace(sch, actions=tuple(rows))


def edited(sch: Schedule, rank: int, text: str) -> Schedule:
    """Replace rank ``rank``'s list by the actions named in ``text`` (e.g. "F0s0 BW0s0")."""
    by_name = {str(a): a for acts in sch.actions for a in acts}
    return with_rank(sch, rank, [by_name[t] for t in text.split()])


def rejects(sch: Schedule, pattern: str, model: P2PModel = P2PModel.BUFFERED_SENDS) -> str:
    with pytest.raises(ValueError, match=re.escape(pattern)) as info:
        validate(sch, model=model)
    return str(info.value)


def test_dropped_recv() -> None:
    sch = one_f_one_b(2, 3)
    acts = [a for a in sch.actions[1] if str(a) != "RECV_F1s1<r0"]
    rejects(
        with_rank(sch, 1, acts),
        "1f1b: rank 1 has 0 RECV_F1s1<r0 actions; expected exactly one, "
        "to match SEND_F1s0>r1 on rank 0",
    )


def test_duplicated_forward() -> None:
    sch = one_f_one_b(2, 3)
    acts = list(sch.actions[0])
    acts.insert(3, Action(K.F, 1, 0))
    rejects(with_rank(sch, 0, acts), "microbatch 1 stage 0 (rank 0): 2 F actions at positions [2, 3]")


def test_reordered_pair_deadlocks() -> None:
    # rank 0 waits for the gradient before sending the activation that produces it
    sch = edited(one_f_one_b(2, 1), 0, "F0s0 RECV_B0s0<r1 SEND_F0s0>r1 BW0s0")
    message = rejects(sch, "deadlock under the buffered-sends p2p model")
    assert "rank 0 waits at RECV_B0s0<r1 (action 1 of 4)" in message
    assert "rank 1 waits at RECV_F0s1<r0 (action 0 of 4)" in message


def test_swapped_recv_and_compute() -> None:
    order = "F0s1 RECV_F0s1<r0 BW0s1 SEND_B0s1>r0 RECV_F1s1<r0 F1s1 BW1s1 SEND_B1s1>r0"
    sch = edited(one_f_one_b(2, 2), 1, order)
    rejects(
        sch,
        "rank 1: F0s1 at position 0 comes before RECV_F0s1<r0 at position 1, "
        "but the forward needs its input",
    )


def test_weight_grad_before_input_grad() -> None:
    sch = zero_bubble_h1(1, 2)
    assert [str(a) for a in sch.actions[0]] == ["F0s0", "B0s0", "W0s0", "F1s0", "B1s0", "W1s0"]
    rejects(edited(sch, 0, "F0s0 W0s0 B0s0 F1s0 B1s0 W1s0"), "but W runs after B")


def test_missing_weight_grad() -> None:
    sch = zero_bubble_h1(1, 2)
    rejects(
        edited(sch, 0, "F0s0 B0s0 W0s0 F1s0 B1s0"),
        "microbatch 1 stage 0 (rank 0): found BW=0 B=1 W=0; expected exactly one BW",
    )


def test_wrong_placement_and_peer() -> None:
    sch = gpipe(2, 1)
    rejects(with_rank(sch, 0, [Action(K.F, 0, 1), *sch.actions[0]]), "stage 1 lives on rank 1")
    bad_peer = [Action(K.SEND_F, 0, 0, 0) if a.kind is K.SEND_F else a for a in sch.actions[0]]
    rejects(with_rank(sch, 0, bad_peer), "peer should be rank 1 (stage 1)")
    too_far = [*sch.actions[0], Action(K.F, 5, 0)]
    rejects(with_rank(sch, 0, too_far), "microbatch outside 0..0")


def test_local_edges_carry_no_p2p() -> None:
    sch = Schedule(
        "local",
        num_ranks=1,
        num_microbatches=1,
        num_stages=2,
        stage_to_rank=(0, 0),
        actions=((Action(K.F, 0, 0), Action(K.SEND_F, 0, 0, 0), Action(K.F, 0, 1),
                  Action(K.BW, 0, 1), Action(K.BW, 0, 0)),),
    )
    rejects(sch, "stages 0 and 1 are both on rank 0; they exchange tensors locally")
    validate(dataclasses.replace(sch, actions=(tuple(a for a in sch.actions[0] if a.is_compute),)))


def test_rendezvous_model() -> None:
    validate(gpipe(3, 4), model=P2PModel.RENDEZVOUS)
    rejects(
        one_f_one_b(2, 3),
        "deadlock under the rendezvous p2p model: rank 0 waits at SEND_F1s0>r1 "
        "(action 3 of 12); rank 1 waits at SEND_B0s1>r0 (action 3 of 12)",
        model=P2PModel.RENDEZVOUS,
    )


def test_simulate_validates_first() -> None:
    sch = edited(one_f_one_b(2, 1), 0, "F0s0 RECV_B0s0<r1 SEND_F0s0>r1 BW0s0")
    with pytest.raises(ValueError, match="deadlock"):
        simulate(sch)


def test_action_and_schedule_shape_errors() -> None:
    with pytest.raises(ValueError, match="needs a peer rank"):
        Action(K.SEND_F, 0, 0)
    with pytest.raises(ValueError, match="takes no peer"):
        Action(K.F, 0, 0, 1)
    with pytest.raises(ValueError, match="microbatch=-1"):
        Action(K.F, -1, 0)
    with pytest.raises(ValueError, match="names ranks"):
        Schedule("x", 1, 1, 1, (3,), ((),))
    with pytest.raises(ValueError, match="2 rank lists for 1 ranks"):
        Schedule("x", 1, 1, 1, (0,), ((), ()))
