"""The rendezvous the join tests run their processes on, for the tests as processes here."""

from ..test_join_processes import rendezvous  # noqa: F401 (a fixture)
