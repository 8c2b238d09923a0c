"""CommOptions' ``listen`` and ``token``: bad values are refused naming the option (and never
showing the token); the token never shows in a repr, a checkpoint or a pickle; on a linked
node they take the place of init_node's, the port moved up by the local rank, and a token
other than the one the node reached the rendezvous with is refused."""

from __future__ import annotations

import pickle

import pytest
import torch

from qcomm.engine import CommOptions
from qcomm.rendezvous.node import LinkedSeat, with_options
from qcomm.sgd import ASSGD

TOKEN = "a-job-token-0123456789abcdef"


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"token": "short-token"}, "token must be a string of at least 16 characters"),
    ({"token": 12345678901234567890}, "token must be a string of at least 16 characters"),
    ({"listen": "10.0.0.1"}, "listen must be 'HOST:PORT', the address this node accepts"),
    ({"listen": "10.0.0.1:99999"}, "listen must be 'HOST:PORT'"),
])
def test_a_bad_listen_or_token_is_refused_naming_it(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError) as info:
        CommOptions(**kwargs)
    assert str(info.value).startswith(message)
    assert "short-token" not in str(info.value)   # a token is never shown
    with pytest.raises(ValueError, match=message.split(" ")[0]):   # the optimizers' keywords
        ASSGD([torch.zeros(2, requires_grad=True)], lr=0.1, **kwargs)


def test_the_token_is_in_no_repr_checkpoint_or_pickle() -> None:
    opt = ASSGD([torch.zeros(4, requires_grad=True)], lr=0.1, token=TOKEN,
                listen="127.0.0.1:0")
    assert opt.comm.token == TOKEN and opt.comm.listen == "127.0.0.1:0"
    assert TOKEN not in repr(opt.comm) and "listen='127.0.0.1:0'" in repr(opt.comm)
    assert "token" not in opt.comm.as_dict()
    assert TOKEN.encode() not in pickle.dumps(opt.state_dict())
    assert TOKEN.encode() not in pickle.dumps(opt.comm)
    back = pickle.loads(pickle.dumps(opt.comm))
    assert back.token is None and back.listen == "127.0.0.1:0"


def _seat(local_rank: int, token: str | None) -> LinkedSeat:
    return LinkedSeat(node=1, nodes=3, rank=2 + local_rank, world_size=6, procs_per_node=2,
                      incarnation=1, rendezvous="10.0.0.9:29400", timeout_s=30.0, starting=3,
                      token=token)


def test_the_options_take_the_place_of_init_nodes_on_a_linked_seat() -> None:
    seat = with_options(_seat(1, None), "0.0.0.0:7000", TOKEN)
    assert (seat.listen, seat.token) == ("0.0.0.0:7001", TOKEN)   # local rank 1: PORT + 1
    assert with_options(_seat(0, TOKEN), None, None) == _seat(0, TOKEN)
    assert with_options(_seat(0, TOKEN), None, TOKEN).token == TOKEN
    with pytest.raises(ValueError, match="is not the job token init_node took") as info:
        with_options(_seat(0, TOKEN), None, "another-token-0123456789")
    assert TOKEN not in str(info.value) and "another-token" not in str(info.value)


@pytest.mark.parametrize(("listen", "token", "encrypt", "words"), [
    (None, None, "1", "links between nodes: Gloo, a group of two per link made through the "
                      "rendezvous, every port open between the nodes; gossip"),
    ("0.0.0.0:7000", TOKEN, "1", "links between nodes: one-port TCP, accepting on "
                                 "0.0.0.0:7000 and dialling the peers that accept less; job "
                                 "token checked, encrypted (AES-256-GCM), the rendezvous "
                                 "through an encrypted tunnel"),
    (None, TOKEN, "0", "one-port TCP, dialling every link (this node accepts none); job token "
                       "checked, in clear"),
    ("0.0.0.0:7000", None, "1", "one-port TCP, accepting on 0.0.0.0:7000 and dialling the "
                                "peers that accept less; no job token, in clear"),
])
def test_the_layout_line_says_what_the_links_between_nodes_run_over(
        monkeypatch: pytest.MonkeyPatch, listen: str | None, token: str | None, encrypt: str,
        words: str) -> None:
    from qcomm.collectives.linked_world import LinkedWorld
    from qcomm.collectives.topology import Topology
    from qcomm.engine.report import topology_line

    monkeypatch.setenv("QCOMM_ENCRYPT", encrypt)
    seat = with_options(_seat(0, None), listen, token)
    topo = Topology(2, rank=seat.rank, world_size=6, world=LinkedWorld(seat))
    _, line = topology_line(topo, CommOptions(wait_free=True), False, 1000)
    assert words in line, line
    assert TOKEN not in line


def test_qcomm_encrypt_other_than_0_or_1_is_refused_by_name(monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    """QCOMM_ENCRYPT=false would otherwise encrypt (anything but "0" did): refused, naming it,
    where the node says what its links run over (at its first step, before any link)."""
    from qcomm.collectives.linked_world import LinkedWorld

    monkeypatch.setenv("QCOMM_ENCRYPT", "false")
    seat = with_options(_seat(0, None), "0.0.0.0:7000", TOKEN)
    with pytest.raises(ValueError, match="environment variable QCOMM_ENCRYPT must be 0 or 1, "
                                         "got 'false'"):
        LinkedWorld(seat).links()
