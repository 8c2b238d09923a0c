"""bench/wait_free_mixing.py: the mixing rules it compares still plug into the wait-free member,
and the code's own rule keeps the property the design relies on (with one member 5 times slower
and fixed optima, the members agree and their average sits at the mean of the optima) where the
rule that mixes only new messages does not."""

from __future__ import annotations

import pytest

from bench import wait_free_mixing as W


@pytest.fixture(scope="module")
def rows() -> dict[str, dict]:
    return {rule: W.run(rule, [5, 1, 1, 1], 1, numel=512, seed=0, drift=0.0)
            for rule in ("lagged", "new-only")}


def test_the_codes_own_rule_agrees_at_the_optimum_with_a_slow_member(rows):
    assert rows["lagged"]["consensus_distance"] < 1e-5
    assert rows["lagged"]["training_gap"] < 1e-5


def test_mixing_only_new_messages_biases_the_average_towards_the_fast_members(rows):
    assert rows["new-only"]["training_gap"] > 0.1
