"""Three members with the job token gossip over TCP links, each a process on localhost, two of
them accepting nothing (no QCOMM_LISTEN, as behind a NAT): their link goes through the relay
(:mod:`qcomm.rendezvous.link_relay`), the others dial member 0's port. A stray with a wrong
token is refused at the relay while they run. No member loses a link or a peer, and they end
with one sum, the same bits on each."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from qcomm.rendezvous.link_relay import RELAY_KEY, LinkRelay
from qcomm.testing.join_world import wait_progress

from ..test_join_processes import _finish, _worker
from .test_admission_processes import TOKEN, _stray


def test_two_members_without_ports_gossip_through_the_relay_and_a_stray_is_refused(
        tmp_path: Path, rendezvous: tuple[int, dist.Store]) -> None:
    port, store = rendezvous
    relay = LinkRelay("127.0.0.1", 0, TOKEN.encode(), wait_s=60)
    address = f"127.0.0.1:{relay.port}"
    store.set(RELAY_KEY, address)
    outs = [tmp_path / f"m{i}.pt" for i in range(3)]
    procs = [_worker(i, port, 600, outs[i], transport="sockets",
                     env={"QCOMM_TOKEN": TOKEN, **({"QCOMM_LISTEN": ""} if i else {})})
             for i in range(3)]
    try:
        wait_progress(store, "progress/0/1", 50, 60)
        said = _finish([_stray(port, "token", "a-wrong-token-0123456789", "--to", "relay")], 60)
        wait_progress(store, "progress/0/1", 200, 60)   # still going after it
    finally:
        logs = _finish(procs, 120)
        relay.close()
    assert "refused: AdmissionError: refused by the other node: wrong or missing job token" \
        in said[0], said
    assert relay.refused == 1 and relay.spliced >= 1
    assert [p.returncode for p in procs] == [0, 0, 0], "\n".join(logs)
    for m, other in ((1, 2), (2, 1)):
        assert f"link to rank {other}: TCP, relayed through {address}, token checked, " \
               "encrypted" in logs[m], logs[m]
    assert "relayed" not in logs[0]
    assert all(TOKEN not in log for log in logs + said)
    res = [torch.load(o, weights_only=True) for o in outs]
    for i, r in enumerate(res):
        assert r["live"] == 3 and r["lost"] == [] and r["losses"] == 0, (i, r)
    assert all(torch.equal(r["sum"], res[0]["sum"]) for r in res)
