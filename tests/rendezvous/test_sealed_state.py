"""A joiner's state through the rendezvous in a job with a token
(:mod:`qcomm.rendezvous.sealed_state`): sealed by the offer, opened by the joiner with the same
bits; an offer from a process without the token, or with a byte changed, is not taken."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from qcomm.rendezvous.joins import _state_key, await_state, offer_state

TOKEN = b"the-job-token-0123456789"
STATE = bytes(range(256)) * 1000


def test_a_sealed_state_arrives_with_the_same_bits_and_unreadable_on_the_way() -> None:
    store = dist.HashStore()
    assert offer_state(store, 1, STATE, token=TOKEN)
    offer, _, _ = store.get(_state_key(1)).decode().split(":")
    assert STATE[:64] not in store.get(f"{_state_key(1)}/{offer}/0")   # encrypted there
    assert await_state(store, 1, 5, token=TOKEN) == STATE


@pytest.mark.parametrize("offered_with", [None, b"a-wrong-token-0123456789"],
                         ids=["no token", "wrong token"])
def test_an_offer_without_the_token_is_not_taken(offered_with: bytes | None) -> None:
    store = dist.HashStore()
    assert offer_state(store, 2, STATE, token=offered_with)
    with pytest.raises(ValueError, match="the state offered to join 2 is not sealed with this "
                                         "job's token"):
        await_state(store, 2, 5, token=TOKEN)


def test_a_changed_byte_is_not_taken() -> None:
    store = dist.HashStore()
    offer_state(store, 3, STATE, token=TOKEN)
    offer, _, _ = store.get(_state_key(3)).decode().split(":")
    key = f"{_state_key(3)}/{offer}/0"
    part = bytearray(store.get(key))
    part[100] ^= 1
    store.set(key, bytes(part))
    with pytest.raises(ValueError, match="not sealed with this job's token"):
        await_state(store, 3, 5, token=TOKEN)
