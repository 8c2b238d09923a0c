"""qcomm.seeds: the derivation tree gives today's streams (pinned values: checkpoints hold gossip
states whose rounds in flight were quantized with them) and distinct streams per coordinate."""

from __future__ import annotations

import torch

from qcomm import seeds

# Values of the derivations as first released (when they lived in the collectives and the
# engine); a change here changes the stochastic-rounding bytes of every run.
GOLDEN = {
    "derive": ([(0,), (5, 1, 2, 3), (2**64 - 1, 7, 0, 9)],
               [16294208416658607535, 509334991330530573, 14287039085276395213]),
    "seal_key": ([(0, 0), (12, 3), (2**20, 7)],
                 [7905728728188956330, -3275371848433122082, -5741748463022317884]),
    "gossip_message_seed": ([(0, 0, 0), (2**63 - 5, 17, 2)],
                            [16920278383203172709, 14563562546459983159]),
    "rail_seed": ([(0, 1), (2**64 - 1, 3)], [1, 9223372036853775808]),
    "stream_key": ([(0, 0), (2**64 - 1, 3)], [2488251732, 374884727]),
}


def test_derivations_give_the_released_values() -> None:
    for name, (args, want) in GOLDEN.items():
        fn = getattr(seeds, name)
        assert [fn(*a) for a in args] == want, name


def test_every_coordinate_changes_the_message_seed() -> None:
    base = seeds.derive(7, 1, 2, 3)
    assert len({base, seeds.derive(8, 1, 2, 3), seeds.derive(7, 0, 2, 3),
                seeds.derive(7, 1, 3, 3), seeds.derive(7, 1, 2, 4), seeds.derive(7, 2, 1, 3)}) == 6
    rounds = {seeds.gossip_message_seed(11, t, m) for t in range(50) for m in range(4)}
    assert len(rounds) == 200
    rails = {seeds.rail_seed(2**64 - 1, rank) for rank in range(8)}
    assert len(rails) == 8 and all(0 <= r < 2**63 for r in rails)


def test_draw_seed_follows_torch_manual_seed() -> None:
    torch.manual_seed(3)
    a = [seeds.draw_seed() for _ in range(3)]
    torch.manual_seed(3)
    assert a == [seeds.draw_seed() for _ in range(3)]
    assert all(0 <= s < seeds.DRAW_BOUND for s in a) and len(set(a)) == 3


def test_mixers_stay_in_their_words() -> None:
    for h in (0, 1, 2**31, 2**32 - 1, 2**40 + 5):
        assert 0 <= seeds.mix32(h) < 2**32
        assert 0 <= seeds.fmix64(h) < 2**64
    assert seeds.mix32(2**32 + 5) == seeds.mix32(5)  # only the low word counts
