"""MNIST-1D data (generated locally, nothing downloaded) and the small 1-D CNN of the demo."""

from __future__ import annotations

import torch
from torch import nn


def make_mnist1d(num_samples: int = 5000, seed: int = 42) -> dict[str, torch.Tensor]:
    """The MNIST-1D data set from ``mnist1d.data.make_dataset`` (procedurally generated).

    Returns:
        ``x`` float32 [N_train, 1, 40], ``y`` int64 [N_train], ``x_test`` float32
        [N_test, 1, 40], ``y_test`` int64 [N_test]; the default 5000 samples split 4000/1000
        as in the MNIST-1D paper.
    """
    from mnist1d.data import get_dataset_args, make_dataset

    args = get_dataset_args()
    args.num_samples = num_samples
    args.seed = seed
    data = make_dataset(args)  # generates; make_dataset never downloads
    as_x = lambda a: torch.as_tensor(a, dtype=torch.float32).unsqueeze(1).contiguous()
    as_y = lambda a: torch.as_tensor(a, dtype=torch.int64)
    return {"x": as_x(data["x"]), "y": as_y(data["y"]),
            "x_test": as_x(data["x_test"]), "y_test": as_y(data["y_test"])}


class ConvNet(nn.Module):
    """Three strided Conv1d layers and a head, like the MNIST-1D paper's CNN. Input float32
    [B, 1, 40], output logits [B, 10].

    ``hidden=0`` is the paper's linear head (5,210 parameters in all); ``hidden=H`` puts one
    ReLU layer of H units in the head. That adds parameters (the bytes data-parallel training
    sends every step) at little compute, so a demo can weigh the two as a bigger model would.
    """

    def __init__(self, channels: int = 25, hidden: int = 0) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv1d(1, channels, 5, stride=2, padding=1), nn.ReLU(),     # 40 -> 19
            nn.Conv1d(channels, channels, 3, stride=2, padding=1), nn.ReLU(),  # 19 -> 10
            nn.Conv1d(channels, channels, 3, stride=2, padding=1), nn.ReLU(),  # 10 -> 5
        )
        self.head: nn.Module = (
            nn.Linear(channels * 5, 10) if hidden == 0 else
            nn.Sequential(nn.Linear(channels * 5, hidden), nn.ReLU(), nn.Linear(hidden, 10)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Top-1 accuracy in percent."""
    model.eval()
    pred = model(x).argmax(dim=1)
    model.train()
    return 100.0 * (pred == y).float().mean().item()
