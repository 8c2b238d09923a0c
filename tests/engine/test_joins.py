"""What the engine checks before nodes linked through the rendezvous exchange anything
(:mod:`qcomm.engine.joins`, :func:`qcomm.engine.agreement.check_job_agreement`): the options
they need (a node of several ranks may come back), and a node whose options or model differ
from the running job's, refused alone with the field named."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from qcomm.engine.agreement import check_job_agreement, fingerprint
from qcomm.engine.joins import check_linked_options
from qcomm.engine.options import CommOptions
from qcomm.rendezvous.node import LinkedSeat

ROBUST = {"wait_free": True, "on_peer_loss": "continue"}


def _seat(ppn: int = 1, incarnation: int = 1, node: int = 1) -> LinkedSeat:
    """Node ``node`` of a job that starts with 3 nodes and may grow to 4."""
    return LinkedSeat(node, 4, node * ppn, 4 * ppn, ppn, incarnation, "127.0.0.1:1", 5.0, 3)


@pytest.mark.parametrize("options", [{}, {"wait_free": True}])
def test_lockstep_or_stopping_at_a_loss_is_refused_naming_both(options: dict) -> None:
    with pytest.raises(ValueError, match=r"need wait_free=True and on_peer_loss='continue'"):
        check_linked_options(CommOptions(**options), _seat())


def test_procs_per_node_must_be_the_nodes_own() -> None:
    check_linked_options(CommOptions(**ROBUST, procs_per_node=2), _seat(ppn=2))
    with pytest.raises(ValueError, match=r"procs_per_node=1 but this node runs 2 ranks"):
        check_linked_options(CommOptions(**ROBUST, procs_per_node=1), _seat(ppn=2))


def test_a_node_of_several_ranks_may_join_a_running_job() -> None:
    for seat in (_seat(ppn=2), _seat(ppn=2, incarnation=2), _seat(ppn=2, node=3)):
        check_linked_options(CommOptions(**ROBUST), seat)


def _row(params: list[torch.Tensor], **options: object) -> list[int]:
    return fingerprint(CommOptions(**{**ROBUST, **options}), params, False)


def test_the_first_node_sets_the_job_and_one_that_differs_is_refused_naming_the_field() -> None:
    store = dist.HashStore()
    params = [torch.zeros(4, 3), torch.zeros(3)]
    check_job_agreement(_row(params), store, "k")          # the first: the job's now
    check_job_agreement(_row(params), store, "k")          # the same: admitted
    with pytest.raises(ValueError, match=r"this node's bits is 2 but the running job's is 4"):
        check_job_agreement(_row(params, bits=2), store, "k")
    with pytest.raises(ValueError, match=r"this node's parameter shapes and dtypes is hash "):
        check_job_agreement(_row([torch.zeros(3, 4), torch.zeros(3)]), store, "k")
    with pytest.raises(ValueError, match=r"this node's communicated parameters is 1 but the "
                                         r"running job's is 2"):
        check_job_agreement(_row(params[:1]), store, "k")
    check_job_agreement(_row(params), store, "k")          # the job's is unchanged


@pytest.mark.parametrize("value", ["keep", None, 1])
def test_a_bad_join_optimizer_state_is_named_with_what_is_allowed(value: object) -> None:
    with pytest.raises(ValueError, match=r"join_optimizer_state must be one of \('copy', "
                                         r"'fresh'\)"):
        CommOptions(**ROBUST, join_optimizer_state=value)


class _Gossip:
    def __init__(self, made: bool) -> None:
        self.made, self.asked = made, []

    def wait_linked(self, timeout_s: float) -> bool:
        self.asked.append(timeout_s)
        return self.made


@pytest.mark.parametrize("made", [True, False])
def test_links_not_made_at_the_start_are_named_in_a_warning(made: bool,
                                                           caplog: pytest.LogCaptureFixture
                                                           ) -> None:
    """The start waits up to the silence bound for its links; links still not made are a
    warning naming the rank and the bound, not silence, and the start goes on."""
    from qcomm.engine.joins import wait_for_links

    gossip = _Gossip(made)
    with caplog.at_level("WARNING", logger="qcomm"):
        assert wait_for_links(gossip, 7.5, "rank 3") is made
    assert gossip.asked == [7.5]
    warned = [r.getMessage() for r in caplog.records if r.name == "qcomm"]
    if made:
        assert warned == []
    else:
        assert len(warned) == 1 and warned[0].startswith(
            "rank 3: not every gossip link was made within 7.5 s of the start")
