"""Unit tests of the cluster benchmark's workloads: the registry, loading the charlm workload
on a rank, and the model fragments of streaming DiLoCo. No root, no processes."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from bench.cluster import charlm, corpus
from bench.cluster import torchft_methods as TF
from bench.cluster import workloads as W


def test_charlm_defaults_are_the_documented_model():
    info = W.WORKLOADS["charlm"]
    assert (info.width, info.depth) == (128, 6)
    m = charlm.CharTransformer(width=info.width, layers=info.depth)
    assert sum(p.numel() for p in m.parameters()) == 1_230_976


def test_charlm_workload_loads_and_differs_per_rank(tmp_path):
    stdlib_corpus = corpus.build()
    path = tmp_path / "charlm.npz"
    corpus.save(stdlib_corpus, path)
    args = SimpleNamespace(width=32, depth=2, heads=4, context=16, eval_windows=8)
    w0 = W.load("charlm", path, rank=0, seed=0, batch=2, total_steps=4, args=args)
    w1 = W.load("charlm", path, rank=1, seed=0, batch=2, total_steps=4, args=args)
    torch.manual_seed(0)
    m = w0.make_model()
    again = W.load("charlm", path, rank=0, seed=0, batch=2, total_steps=4, args=args)
    with torch.no_grad():
        assert w0.loss(m, 0).item() != w1.loss(m, 0).item()  # each rank has its own batches
        assert w0.loss(m, 1).item() == again.loss(m, 1).item()  # the stream is seeded
    assert w0.evaluate(m) == w1.evaluate(m)  # one validation set
    assert w0.data_config["fingerprint"] == corpus.fingerprint(stdlib_corpus)


# ---------------------------------------------------------------------------------------------
# workload registry


def test_workload_registry():
    assert list(W.WORKLOADS) == ["mnist1d", "mnist1d-bn", "charlm"]
    m, c = W.WORKLOADS["mnist1d"], W.WORKLOADS["charlm"]
    assert (m.metric, m.goal, m.optimizer) == ("test_acc", "max", "sgd")
    assert (c.metric, c.goal, c.optimizer) == ("val_loss", "min", "adamw")
    assert m.reached(0.71, 0.70) and not m.reached(0.69, 0.70)
    assert c.reached(1.89, 1.90) and not c.reached(1.91, 1.90)


def test_parse_workloads():
    assert W.parse_workloads("charlm, mnist1d") == ["charlm", "mnist1d"]
    with pytest.raises(ValueError, match="known"):
        W.parse_workloads("cifar")
    with pytest.raises(ValueError, match="known"):
        W.parse_workloads(" ")
    with pytest.raises(ValueError, match=r"unknown \['mnist-1d'\].*; did you mean 'mnist1d'\?$"):
        W.parse_workloads("charlm,mnist-1d")
    with pytest.raises(ValueError) as info:
        W.parse_workloads("cifar")
    assert "did you mean" not in str(info.value)


def test_mlp_size_is_the_documented_one():
    m = W.make_mlp(512, 3)
    assert sum(p.numel() for p in m.parameters()) == 551_434


def test_cnn_with_batchnorm_is_the_documented_one():
    info = W.WORKLOADS["mnist1d-bn"]
    m = W.make_cnn_bn(info.width, info.depth)
    assert sum(p.numel() for p in m.parameters()) == 433_418
    assert sum(isinstance(x, torch.nn.BatchNorm1d) for x in m.modules()) == 3
    assert m(torch.randn(5, 40)).shape == (5, 10)


def test_the_cnn_workload_evaluates_with_running_statistics(tmp_path):
    """evaluate() puts BatchNorm in eval mode (the running statistics, not the test set's own)
    and leaves the model's mode and buffers as they were."""
    path = tmp_path / "mnist1d.npz"
    W.make_data("mnist1d-bn", path, seed=0, num_samples=400)
    args = SimpleNamespace(width=8, depth=3)
    w = W.load("mnist1d-bn", path, rank=0, seed=0, batch=4, total_steps=2, args=args)
    torch.manual_seed(0)
    m = w.make_model()
    m.train()
    with torch.no_grad():
        w.loss(m, 0)   # one forward in train mode: the running statistics move
    buffers = {k: v.clone() for k, v in m.named_buffers()}
    acc = w.evaluate(m)
    assert m.training and all(torch.equal(v, buffers[k]) for k, v in m.named_buffers())
    d = np.load(path)
    m.eval()
    with torch.no_grad():
        predicted = m(torch.from_numpy(d["x_test"]).float()).argmax(1)
    assert acc == float((predicted == torch.from_numpy(d["y_test"])).float().mean())


def test_fragments_of_the_cnn_hold_every_parameter_once():
    m = W.make_cnn_bn(16, 3)
    frags = TF.split_fragments(m, 4)
    ids = [id(p) for f in frags for p in f.parameters()]
    assert sorted(ids) == sorted(id(p) for p in m.parameters())


# ---------------------------------------------------------------------------------------------
# streaming DiLoCo's fragments


@pytest.mark.parametrize(("sizes", "count", "want"), [
    ([5, 5, 5, 5], 2, [2, 2]),
    ([1, 10, 1, 1, 1], 2, [2, 3]),
    ([3, 1, 1, 1, 3], 3, [1, 3, 1]),
    ([7], 1, [1]),
    ([1, 2, 3], 3, [1, 1, 1]),
])
def test_partition_is_contiguous_and_balanced(sizes, count, want):
    assert TF.partition(sizes, count) == want


def test_partition_rejects_bad_counts():
    with pytest.raises(ValueError, match="fragments"):
        TF.partition([1, 2], 3)
    with pytest.raises(ValueError, match="fragments"):
        TF.partition([1, 2], 0)


@pytest.mark.parametrize("count", [1, 2, 3, 4, 5])
def test_fragments_of_the_transformer_hold_every_parameter_once(count):
    m = charlm.CharTransformer()
    frags = TF.split_fragments(m, count)
    assert len(frags) == count
    ids = [id(p) for f in frags for p in f.parameters()]
    assert len(ids) == len(set(ids))
    assert set(ids) == {id(p) for p in m.parameters()}
    # contiguous: the embeddings open the first fragment, the head closes the last
    assert frags[0][0] is m.tok and frags[-1][-1] is m.head


def test_fragments_of_the_mlp_are_its_layers():
    m = W.make_mlp(512, 3)
    frags = TF.split_fragments(m, 4)
    assert [sum(p.numel() for p in f.parameters()) for f in frags] == \
        [20_992, 262_656, 262_656, 5_130]
    two = TF.split_fragments(m, 2)
    assert [sum(p.numel() for p in f.parameters()) for f in two] == \
        [20_992 + 262_656, 262_656 + 5_130]


def test_fragments_refuse_parameters_outside_layers():
    class Loose(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)
            self.scale = torch.nn.Parameter(torch.ones(1))

    with pytest.raises(ValueError, match="outside a layer"):
        TF.split_fragments(Loose(), 1)
