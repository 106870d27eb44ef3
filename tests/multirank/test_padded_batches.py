"""Batches as Hugging Face's data pipeline makes them (issue 39), against one process.

- Ranks with the same rows but other sequence lengths (each rank's batch padded to its own
  longest row, labels -100 on the padding) train at every stage with no setting: the loss is
  the mean of the ranks' means, as under DDP.
- A `BatchEncoding` batch (and a `UserDict` nested in a dict) is a batch: the same step, bit
  for bit, as the plain dict.
- `fz.MicroBatches` of different lengths with Spec.accumulate="sum" and a loss divided by the
  step's label tokens on every rank (`fz.sum_over_ranks`): one process's token-weighted loss on
  all of the step's rows; with "mean", the micro-batches' mean.
One world-2 spawn runs every scenario.
"""
from __future__ import annotations

from collections import UserDict

import pytest
import torch
import torch.nn.functional as F

import fz
from fz.testing.spawn import run_ranks

from support.helpers import CFG, max_rel, params_rel

BatchEncoding = pytest.importorskip("transformers").BatchEncoding

STEPS, ROWS = 3, 2
TOL = 2e-5  # fp32: sums over other groupings (per-rank means, micro-batches) round differently


def padded(step: int, rank: int, micro: int = 0) -> dict[str, torch.Tensor]:
    """ROWS rows of lengths that differ per step, rank and micro-batch, right-padded to their
    longest with token 0 (labels -100 there)."""
    g = torch.Generator().manual_seed(100 * step + 10 * rank + micro)
    lengths = torch.randint(4, CFG.seq + 1, (ROWS,), generator=g)
    width = int(lengths.max())
    ids = torch.zeros(ROWS, width, dtype=torch.long)
    labels = torch.full((ROWS, width), -100)
    for i, n in enumerate(lengths.tolist()):
        ids[i, :n] = torch.randint(1, CFG.vocab, (n,), generator=g)
        labels[i, :n] = ids[i, :n]
    return {"input_ids": ids, "labels": labels}


def token_losses(model, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of next-token losses, tokens counted) of a padded batch."""
    logits = model(batch["input_ids"])[:, :-1]
    labels = batch["labels"][:, 1:]
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100,
                           reduction="sum")
    return loss, (labels != -100).sum()


def mean_loss(model, batch):
    inner = batch["x"] if "x" in batch else batch
    total, n = token_losses(model, inner)
    return total / n


def _model():
    from fz.testing.gpt import GPT
    torch.manual_seed(0)
    return GPT(CFG)


def _spec(stage: int, **kw):
    kw.setdefault("loss_fn", mean_loss)
    return fz.Spec(stage=stage, optimizer=fz.optim.adamw(lr=1e-2, weight_decay=0.01), clip_grad_norm=1.0, **kw)


def _scenarios(rank: int, world: int) -> dict:
    out: dict = {}
    for stage in (0, 1, 2, 3):  # (a) other lengths per rank and step, mean mode, no setting
        state = fz.init(_model(), _spec(stage))
        losses = []
        for s in range(STEPS):
            state, loss = fz.train_step(state, padded(s, rank))
            losses.append(float(loss.detach()))
        out["lengths", stage] = (losses, fz.full_params(state))

    def run(make):  # (b) the same data as a dict, a BatchEncoding, a UserDict inside a dict
        state = fz.init(_model(), _spec(3))
        losses = []
        for s in range(STEPS):
            state, loss = fz.train_step(state, make(padded(s, rank)))
            losses.append(float(loss.detach()))
        evaluated = float(fz.eval_step(state, make(padded(9, rank))))
        return losses, evaluated, fz.full_params(state)
    out["dict"] = run(dict)
    out["encoding"] = run(BatchEncoding)
    out["nested"] = run(lambda b: {"x": UserDict(b)})

    def counted(model, batch):  # transformers' compute_loss: the step's tokens on every rank, x ranks
        total, _ = token_losses(model, batch)
        return total / items * world

    for stage in (2, 3):  # (c) micro-batches of their own lengths, weighted by tokens
        state = fz.init(_model(), _spec(stage, loss_fn=counted, accumulate="sum"))
        losses = []
        for s in range(STEPS):
            step = fz.MicroBatches(padded(s, rank, m) for m in range(2 + s % 2))  # 2 or 3 micro-batches
            items = fz.sum_over_ranks(state, sum((b["labels"][:, 1:] != -100).sum() for b in step))
            state, loss = fz.train_step(state, step)
            losses.append(float(loss.detach()))
        out["tokens", stage] = (losses, fz.full_params(state))
    state = fz.init(_model(), _spec(1, grad_accum=2))  # (d) mean of the micro-batches, however many
    losses = []
    for s in range(STEPS):
        state, loss = fz.train_step(state, fz.MicroBatches(padded(s, rank, m) for m in range(2 + s % 2)))
        losses.append(float(loss))
    out["micro_mean"] = (losses, fz.full_params(state))
    out["summed"] = (fz.sum_over_ranks(state, rank + 1), fz.sum_over_ranks(state, 0.5))
    return out


def _reference(world: int, weigh: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process: each step's loss from every rank's micro-batches, "tokens" (all the step's
    label tokens weighted alike), "ranks" (the mean of ranks' means) or "micro" (of ranks' means
    of micro-batch means), AdamW(weight_decay=0.01) and clipping at 1.0 as the Spec."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    losses = []
    for s in range(STEPS):
        micro = range(2 + s % 2) if weigh != "ranks" else [0]
        parts = [[token_losses(model, padded(s, r, m)) for m in micro] for r in range(world)]
        if weigh == "tokens":
            loss = sum(t for p in parts for t, _ in p) / sum(n for p in parts for _, n in p)
        else:
            loss = sum(sum(t / n for t, n in p) / len(p) for p in parts) / world
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss))
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


@pytest.fixture(scope="module")
def results():
    return run_ranks(2, _scenarios, timeout=300)


def test_other_sequence_lengths_per_rank_train_at_every_stage_as_one_process(results):
    want, want_params = _reference(2, "ranks")
    for res in results:
        for stage in (0, 1, 2, 3):
            losses, params = res["lengths", stage]
            assert max_rel(losses, want) < TOL, (stage, losses, want)
            assert params_rel(params, want_params) < 1e-4, stage


def test_batch_encoding_and_nested_user_dict_are_batches_bit_for_bit(results):
    for res in results:
        assert res["encoding"][0] == res["dict"][0] and res["nested"][0] == res["dict"][0]
        assert res["encoding"][1] == res["dict"][1] and res["nested"][1] == res["dict"][1]
        for name, t in res["dict"][2].items():
            assert torch.equal(res["encoding"][2][name], t) and torch.equal(res["nested"][2][name], t), name


def test_micro_batches_weighted_by_the_steps_tokens_on_every_rank(results):
    want, want_params = _reference(2, "tokens")
    for res in results:
        for stage in (2, 3):
            losses, params = res["tokens", stage]
            assert max_rel(losses, want) < TOL, (stage, losses, want)
            assert params_rel(params, want_params) < 1e-4, stage


def test_micro_batches_averaged_by_their_count_in_mean_mode(results):
    want, want_params = _reference(2, "micro")
    for res in results:
        losses, params = res["micro_mean"]
        assert max_rel(losses, want) < TOL, (losses, want)
        assert params_rel(params, want_params) < 1e-4


def test_sum_over_ranks_is_exact_and_keeps_integers(results):
    for res in results:
        ints, floats = res["summed"]
        assert ints.dtype == torch.int64 and int(ints) == 3
        assert floats.dtype == torch.float64 and float(floats) == 1.0
