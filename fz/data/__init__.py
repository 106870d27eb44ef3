"""Data: this rank's batch for each step, with the position kept in `state.data`.

    loader = fz.data.loader(dataset, state, micro_batch=8)
    for batch in loader:
        state, loss = fz.train_step(state, batch)
    fz.save(loader.attach(state), "ckpt")       # fz.restore + fz.data.loader resume exactly

Modules: dataloader (`loader`, `Loader`), steps (what the workers run), order (the global
sample order and the rule that makes a resume exact at any world size).
"""
from fz.data.dataloader import Loader, loader
from fz.data.order import Layout, epoch_order

__all__ = ["Layout", "Loader", "epoch_order", "loader"]
