"""Mixing weights for gossip: a symmetric, doubly stochastic matrix W over the graph.

CHOCO's mixing step is ``x_i += gamma * sum_j w_ij (x_hat_j - x_hat_i)``. Symmetry makes the term
antisymmetric between i and j, so the average of x over nodes is preserved; W's spectral gap
``1 - max(|lambda_2|, |lambda_n|)`` sets how fast consensus is reached.

* ``uniform``: ``w_ij = 1 / (d + 1)`` for j in N(i) and for j = i (d = degree). Doubly stochastic
  only on a regular graph, which every graph of :mod:`.graphs` is; irregular adjacency is refused.
* ``metropolis``: ``w_ij = 1 / (1 + max(d_i, d_j))`` for j in N(i), ``w_ii = 1 - sum_j w_ij``
  (Metropolis-Hastings): symmetric and doubly stochastic on any undirected graph; equal to
  uniform on a regular one.

Weights are computed in float64; the codec accumulates them as float32 (``w_ij`` and ``w_ji`` are
the same float32, so symmetry is exact; row sums are 1 up to one float32 rounding).
"""

from __future__ import annotations

import torch

from qcomm.validation import check_choice

from .graphs import adjacency

MIXINGS = ("uniform", "metropolis")


def check_mixing(mixing: object) -> str:
    """Return ``mixing`` if it names a known rule, else raise ValueError naming the argument."""
    return check_choice("mixing", mixing, MIXINGS)  # type: ignore[return-value]


def weights_from_adjacency(adj: list[list[int]], mixing: str) -> torch.Tensor:
    """float64 ``[n, n]`` mixing matrix for an undirected adjacency list (``adj[i]``: neighbours
    of i, without i)."""
    check_mixing(mixing)
    n = len(adj)
    deg = [len(a) for a in adj]
    for i, a in enumerate(adj):
        if i in a or any(i not in adj[j] for j in a):
            raise ValueError(f"adjacency must be undirected without self loops (node {i})")
    if mixing == "uniform" and len(set(deg)) > 1:
        raise ValueError("mixing='uniform' needs a regular graph (every node of equal degree); "
                         "use mixing='metropolis'")
    w = torch.zeros(n, n, dtype=torch.float64)
    for i, a in enumerate(adj):
        for j in a:
            w[i, j] = 1.0 / (1 + (deg[i] if mixing == "uniform" else max(deg[i], deg[j])))
    # The diagonal closes each row; subtracting in the same order everywhere keeps W symmetric.
    w += torch.diag(1.0 - w.sum(dim=1))
    return w


def mixing_matrix(graph: str, n: int, mixing: str = "uniform") -> torch.Tensor:
    """float64 ``[n, n]`` symmetric, doubly stochastic W for ``graph`` on ``n`` nodes."""
    return weights_from_adjacency(adjacency(graph, n), mixing)


def spectral_gap(w: torch.Tensor) -> float:
    """``1 - max(|lambda_2|, |lambda_n|)`` of a symmetric W (1.0 for a single node).

    Positive iff repeated mixing with W converges to the average (graph connected, W aperiodic).
    """
    if w.shape[0] == 1:
        return 1.0
    ev = torch.linalg.eigvalsh(w.to(torch.float64)).abs().sort(descending=True).values
    return float(1.0 - ev[1])
