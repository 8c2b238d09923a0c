"""One node of a job linked through qcomm's rendezvous, under Lightning: run by the node's own
``torchrun --standalone`` with ``QCOMM_RENDEZVOUS`` set (test_lightning_rendezvous.py).

    torchrun --standalone --nproc-per-node P lightning_linked_node.py OUT_DIR

Fits the tests' tiny module for 2 epochs with ``QcommStrategy(**SLOW_LINK)``, a validation
every epoch; each rank writes ``OUT_DIR/rank<job rank>.pt``: its parameters after fit and at
each validation, its qcomm stats, the samples it trained on, Lightning's world as it saw it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the checkout's qcomm, tests

from tests.integrations.lightning_bodies import flat_params, loader, make_module


def main(out: Path) -> None:
    import lightning as L
    from lightning.pytorch.callbacks import Callback

    from qcomm.integrations.lightning import QcommStrategy
    from qcomm.rendezvous import linked_seat
    from qcomm.sgd import SLOW_LINK

    seen: dict[str, Any] = {"val_params": [], "samples": []}

    class Grab(Callback):
        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, i: int) -> None:
            seen["samples"].append(batch[0][:, 0].clone())   # which samples: their first feature

        def on_validation_start(self, trainer: Any, module: Any) -> None:
            seen["val_params"].append(flat_params(module))

        def on_train_end(self, trainer: Any, module: Any) -> None:
            seen["stats"] = trainer.strategy.qcomm_optimizer.stats()
            seen["lightning"] = (trainer.world_size, trainer.global_rank)

    torch.set_num_threads(1)
    module = make_module()
    # Lightning's world is the node: its torchrun's ranks, num_nodes=1 (the default).
    procs = int(os.environ["LOCAL_WORLD_SIZE"])
    trainer = L.Trainer(accelerator="cpu", devices=procs,
                        strategy=QcommStrategy(**SLOW_LINK, timeout_s=60),
                        max_epochs=2, default_root_dir=out, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=2, callbacks=[Grab()])
    trainer.fit(module, train_dataloaders=loader(), val_dataloaders=loader(False))
    seat = linked_seat()
    assert seat is not None, "the rendezvous launch took no seat"
    torch.save({"params": flat_params(module), "seat": (seat.node, seat.rank, seat.world_size),
                "samples": torch.cat(seen["samples"]), **{k: seen[k] for k in
                                                          ("val_params", "stats", "lightning")}},
               out / f"rank{seat.rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
