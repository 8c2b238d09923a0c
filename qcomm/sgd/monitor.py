"""The figures a multi-node job is watched by, as scalars for any logger, in one call.

    from torch.utils.tensorboard import SummaryWriter
    from qcomm.sgd import log_stats

    writer = SummaryWriter()
    for step, (x, y) in enumerate(loader):
        ...
        opt.step()
        if step % 25 == 0:
            log_stats(opt, writer, step)      # qcomm/bytes_inter, qcomm/live_nodes, ...

``log_stats`` writes to whatever the job already logs with: torch's ``SummaryWriter``
(``add_scalar``), a Lightning logger (``log_metrics``), a wandb run or anything with
``log(dict, step=...)``, or a ``logging.Logger`` (one line). :func:`stats_scalars` gives the same
figures as a dict, for anything else. Neither is collective: each rank reports its own figures
(call it on rank 0 alone if one line per job is wanted).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from qcomm.engine.report import lost_and_back

__all__ = ["log_stats", "stats_scalars"]


def stats_scalars(stats: Mapping[str, Any], *, prefix: str = "qcomm/") -> dict[str, float]:
    """The figures of ``opt.stats()`` worth a chart, each one float, keys ``prefix + name``.

    Args:
        stats: the dict of :meth:`qcomm.sgd.HierarchicalOptimizer.stats` (this rank's).
        prefix: put before every name (``"qcomm/"``: TensorBoard groups them in one section).

    Returns:
        ``steps`` (steps applied), ``skipped_steps``, ``bytes_inter`` and ``bytes_intra``
        (bytes this rank sent between nodes and inside its node, since the start),
        ``messages_inter``, ``gossip_rounds`` (rounds started). With ``wait_free`` also
        ``live_nodes``, ``lost_nodes`` (neighbours dropped and not back), ``joins``
        (returns of dropped neighbours), ``lag_rounds`` (the most rounds this rank is ahead
        of a neighbour whose rounds it applied) and ``mix_lag`` (the mean age, in rounds, of
        the neighbour fragments its rounds mixed; ``staleness`` when every message came in
        time); ``consensus_distance`` when the stats were asked for it.
    """
    if not isinstance(stats, Mapping):
        raise TypeError(f"stats must be the dict of opt.stats(), got {type(stats).__name__}")
    bytes_sent, messages = stats["bytes_sent"], stats["messages_sent"]
    out = {
        "steps": stats["steps"],
        "skipped_steps": stats["skipped_steps"],
        "bytes_inter": bytes_sent["inter"],
        "bytes_intra": bytes_sent["intra"],
        "messages_inter": messages["inter"],
        "gossip_rounds": stats["gossip_rounds"],
    }
    if "live_nodes" in stats:   # the wait-free gossip's own figures
        still, _ = lost_and_back(list(stats["dropped_ranks"]), list(stats["rejoined_ranks"]))
        lags = stats["mix_lag_rounds"]
        mixed = sum(lags.values())
        out.update(
            live_nodes=stats["live_nodes"],
            lost_nodes=len(still),
            joins=len(stats["rejoined_ranks"]),
            lag_rounds=max(stats["lag_rounds"].values(), default=0),
            # Rounds that mixed nothing yet (none counted) are left out of the mean.
            mix_lag=(sum(int(s) * n for s, n in lags.items()) / mixed if mixed else 0.0),
        )
    if stats.get("consensus_distance") is not None:
        out["consensus_distance"] = stats["consensus_distance"]
    return {prefix + name: float(value) for name, value in out.items()}


def log_stats(opt: Any, sink: Any, step: int, *, prefix: str = "qcomm/") -> dict[str, float]:
    """Report ``opt.stats()`` (:func:`stats_scalars`) to ``sink`` at ``step``; return them.

    Args:
        opt: a :class:`~qcomm.sgd.HierarchicalOptimizer` (ASSGD included), or anything with
            its ``stats()``.
        sink: where the figures go, the first that fits: ``add_scalar(tag, value, step)``
            (torch's ``SummaryWriter``), ``log_metrics(dict, step)`` (Lightning's loggers,
            MLflow's client style), a ``logging.Logger`` (one INFO line), or
            ``log(dict, step=step)`` (wandb, Aim, ...).
        step: the step to file them under (int >= 0).
        prefix: put before every name.

    Raises:
        TypeError: ``opt`` has no ``stats()``, or ``sink`` none of the methods above (named);
            nothing was written then.
    """
    stats = getattr(opt, "stats", None)
    if not callable(stats):
        raise TypeError(f"opt must be a qcomm optimizer (with stats()), got "
                        f"{type(opt).__name__}")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    # Checked before stats() is read, so a wrong sink costs nothing and writes nothing.
    if not (callable(getattr(sink, "add_scalar", None))
            or callable(getattr(sink, "log_metrics", None))
            or isinstance(sink, logging.Logger) or callable(getattr(sink, "log", None))):
        raise TypeError(
            f"sink must have add_scalar(tag, value, step) (torch's SummaryWriter), "
            f"log_metrics(dict, step) (a Lightning logger), log(dict, step=...) (wandb) or be "
            f"a logging.Logger; got {type(sink).__name__}")
    scalars = stats_scalars(stats(), prefix=prefix)
    if callable(getattr(sink, "add_scalar", None)):
        for tag, value in scalars.items():
            sink.add_scalar(tag, value, step)
    elif callable(getattr(sink, "log_metrics", None)):
        sink.log_metrics(scalars, step)
    elif isinstance(sink, logging.Logger):
        # A Logger has log(level, msg): it must not be taken for wandb's log(dict).
        sink.info("step %d: %s", step,
                  " ".join(f"{k.removeprefix(prefix)}={v:g}" for k, v in scalars.items()))
    else:
        sink.log(scalars, step=step)
    return scalars
