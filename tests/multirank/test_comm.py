"""Communication volume per step equals the ZeRO formula; overlap, prefetch and torch.compile
change nothing."""
from __future__ import annotations

import pytest
import torch

import fz
from fz.model import standin
from fz.sharding.comm import Comm
from fz.sharding.sync import local_data
from fz.testing.gpt import GPTConfig

from support.helpers import CFG, make_model, rank_batches, spec
from support.ranks import cached_runs


def _arriving(state) -> bool:
    """Whether some parameter bucket of `state` is still being all-gathered (a leaf-level future)."""
    return any(local_data(f._local_tensor)[1] is not None for f in state.param_flats)


def _runs(rank, world):
    import os
    out = {}
    for mode in ("native", "pairwise", "auto"):
        os.environ["FZ_COLLECTIVES"] = mode
        for precision in ("fp32", "bf16"):
            for stage in (0, 1, 2, 3):
                state = fz.init(make_model(), spec(stage, 1, precision=precision))
                state, loss = fz.train_step(state, rank_batches(world, 1, 1)[0][rank])
                out["deferred", mode, precision, stage] = _arriving(state)
                out["link", mode, precision, stage] = Comm(state.plan).link is not None
                rep = fz.comm_report(state)
                out[mode, precision, stage] = (rep.payload, rep.sent_total, float(loss), fz.full_params(state))
                assert not _arriving(state)  # reading the parameters' values waited for them
    del os.environ["FZ_COLLECTIVES"]
    # a state whose parameters are still arriving: every way of using it sees them complete
    for how in ("donate", "keep", "replace", "eval"):
        state = fz.init(make_model(), spec(1, 1))
        batches = rank_batches(world, 1, 3)
        losses = []
        for i, per_rank in enumerate(batches):
            batch = per_rank[rank]
            if i == 1 and how == "keep":
                old = state
                state, loss = fz.train_step(state, batch, donate=False)
                fz.train_step(old, batch, donate=False)  # the old state is still whole and usable
            elif i == 1 and how == "replace":
                state, loss = fz.train_step(state.replace(data={"pos": 1}), batch)
            elif i == 1 and how == "eval":
                losses.append(float(fz.eval_step(state, batch)))
                state, loss = fz.train_step(state, batch)
            else:
                state, loss = fz.train_step(state, batch)
            losses.append(float(loss))
        out["sync", how] = (losses, fz.full_params(state))
    for prefetch in (0, 1, 2):
        state = fz.init(make_model(), spec(3, 2, prefetch=prefetch, live_buckets=2 + prefetch))
        losses = []
        for per_rank in rank_batches(world, 2, 4):
            state, loss = fz.train_step(state, per_rank[rank])
            losses.append(float(loss))
        out["prefetch", prefetch] = (losses, fz.full_params(state), int(state.metrics["live_buckets"]))
        out["unprefetched", prefetch] = int(state.metrics["unprefetched"])
    deep = GPTConfig(vocab=64, seq=16, dim=32, heads=2, layers=6)
    for checkpointed, prefetch in ((False, 0), (True, 0), (True, 1)):
        state = fz.init(make_model(cfg=deep), spec(3, 2, prefetch=prefetch, activation_checkpointing=checkpointed))
        losses, most = [], 0
        for per_rank in rank_batches(world, 2, 3, cfg=deep):
            state, loss = fz.train_step(state, per_rank[rank])
            losses.append(float(loss))
            most = max(most, int(state.metrics["live_buckets"]))
        out["checkpointed", checkpointed, prefetch] = (losses, fz.full_params(state), most)
    # without grad (eval_step, apply) each block's gathered parameters go with its call too
    seen: dict = {}
    model = make_model(cfg=deep)
    model.blocks[-1].register_forward_hook(lambda *_: seen.update(live=standin._RUNNER.get().live))
    state = fz.init(model, spec(3, 1))
    batch = rank_batches(world, 1, 1, cfg=deep)[0][rank]
    state, _ = fz.train_step(state, batch)
    fz.eval_step(state, batch)
    out["no_grad_live", "eval_step"] = seen["live"].max_buckets
    fz.apply(state, batch[:, :-1])
    out["no_grad_live", "apply"] = seen["live"].max_buckets
    for live in (3, 5, 100):  # room for 0, 2 and every block to stay gathered from forward to backward
        state = fz.init(make_model(), spec(3, 2, live_buckets=live))
        losses, most = [], 0
        for per_rank in rank_batches(world, 2, 3):
            state, loss = fz.train_step(state, per_rank[rank])
            losses.append(float(loss))
            most = max(most, int(state.metrics["live_buckets"]))
        out["live", live] = (losses, fz.full_params(state), most,
                             fz.comm_report(state).payload["all_gather"])
    for stage in (0, 3):
        for compile_ in (False, "aot_eager"):
            state = fz.init(make_model(), spec(stage, 2, compile=compile_))
            losses, most = [], 0
            for per_rank in rank_batches(world, 2, 3):
                state, loss = fz.train_step(state, per_rank[rank])
                losses.append(float(loss))
                most = max(most, int(state.metrics["live_buckets"]))
            out["compile", stage, compile_] = (losses, fz.full_params(state), most)
    return out


@pytest.fixture(scope="module")
def results():
    return cached_runs(2, _runs, timeout=300)


def test_bytes_per_step_match_formula(results):
    n = 2
    model = make_model()
    psi = sum(p.numel() for p in model.parameters())
    root = sum(p.numel() for name, p in model.named_parameters() if not name.startswith("blocks."))
    frac = (n - 1) / n
    for precision, el in (("fp32", 4), ("bf16", 2)):
        want = {
            0: 2 * frac * 4 * psi,  # all-reduce of fp32 gradients
            1: frac * (4 * psi + el * psi),  # reduce-scatter fp32 grads + all-gather params
            2: frac * (4 * psi + el * psi),
            # all-gather every block for forward and again for backward (the root stays gathered),
            # reduce-scatter all gradients in fp32
            3: frac * (el * (2 * psi - root) + 4 * psi),
        }
        # gloo's fast paths (reduce-scatter as a pairwise exchange, all-gather as broadcasts)
        # move the same bytes as the native collectives
        fast = want
        for stage in (0, 1, 2, 3):
            for res in results:
                payload, sent, loss, params = res["native", precision, stage]
                assert sent == pytest.approx(want[stage]), (precision, stage, payload)
                assert payload.get("scalar", 0) <= (1 + 5 * n) * 8 + 8  # the loss vector (fz/step/agree.py) + norm only
                for mode in ("pairwise", "auto"):  # gloo point-to-point; shared memory (fz/distributed/shm.py)
                    payload, sent, fast_loss, fast_params = res[mode, precision, stage]
                    assert sent == pytest.approx(fast[stage]), (mode, precision, stage, payload)
                    assert fast_loss == loss and all(torch.equal(fast_params[k], params[k]) for k in params)
                    assert res["link", mode, precision, stage] == (mode == "auto")


def test_stage_1_2_parameter_all_gather_runs_into_the_next_step(results):
    """After a stage 1-2 update the all-gathers are still in flight when train_step returns
    (the next forward overlaps them); the losses and parameters above match the native
    path, which shows nothing read a parameter before it arrived."""
    for res in results:
        for mode in ("native", "pairwise", "auto"):
            for precision in ("fp32", "bf16"):
                assert [res["deferred", mode, precision, s] for s in (0, 1, 2, 3)] == [False, True, True, False]


def test_state_with_parameters_in_flight_is_whole_to_every_use(results):
    for res in results:
        base_losses, base_params = res["sync", "donate"]
        for how in ("keep", "replace", "eval"):
            losses, params = res["sync", how]
            if how == "eval":  # the eval loss sits before the step's loss; it saw the updated params
                assert losses[1] == pytest.approx(losses[2], rel=1e-6)
                losses = losses[:1] + losses[2:]
            assert losses == base_losses, how
            assert all(torch.equal(params[k], base_params[k]) for k in base_params), how


def test_prefetch_leaves_only_the_root_to_wait_for(results):
    """With prefetch on, once the first step has learned the call order, every block's gather
    (the first block's in forward, the last block's for backward included) is in flight
    before it is needed; only the root's, first of all, is not. Without prefetch none is."""
    micro = 2
    for res in results:
        assert res["unprefetched", 1] == res["unprefetched", 2] == micro  # the root, once per micro-batch
        # without prefetch: the root, every block for forward and again for backward
        assert res["unprefetched", 0] == micro * (1 + 2 * CFG.layers)


def test_prefetch_does_not_change_results(results):
    for res in results:
        base_losses, base_params, live0 = res["prefetch", 0]
        for prefetch in (1, 2):
            losses, params, live = res["prefetch", prefetch]
            assert losses == base_losses
            assert all((params[k] == base_params[k]).all() for k in base_params)
            assert live <= 2 + prefetch
        assert live0 <= 2


def test_checkpointed_blocks_let_go_of_their_gathers_after_backward(results):
    """With activation checkpointing each block's recompute gathers it again for its backward,
    and that gather dies with the block's backward: torch's recompute stops early with an
    exception, which used to leave the tensors bound to the block until the step's end (every
    bucket of a 2.8B GPT alive at once: 5.3 GB of a 6.0 GB device peak on an H200). The same
    losses and parameters as without checkpointing, bit for bit."""
    for res in results:
        base_losses, base_params, _ = res["checkpointed", False, 0]
        for prefetch in (0, 1):
            losses, params, live = res["checkpointed", True, prefetch]
            assert losses == base_losses
            assert all(torch.equal(params[k], base_params[k]) for k in base_params)
            assert live <= 2 + prefetch, (prefetch, live)  # of 7 buckets: the root, a block, those prefetched


def test_blocks_called_without_grad_let_go_of_their_gathers(results):
    """eval_step and apply at stage 3 (generate too): a block's gathered parameters die with its
    call; they stayed bound to the block until the call's end, the whole model gathered at once."""
    for res in results:
        for api in ("eval_step", "apply"):
            assert res["no_grad_live", api] <= 3, (api, res["no_grad_live", api])  # of 7: root, block, next


def test_compiled_blocks_give_the_same_training(results):
    for res in results:
        for stage in (0, 3):
            eager_losses, eager_params, _ = res["compile", stage, False]
            losses, params, live = res["compile", stage, "aot_eager"]
            assert max(abs(a - b) / abs(b) for a, b in zip(losses, eager_losses)) < 1e-6
            assert all(float((params[k] - eager_params[k]).abs().max()) < 1e-5 for k in params)
            if stage == 3:
                assert live <= 3  # gathered blocks are still freed between uses


def test_live_bucket_budget_keeps_blocks_gathered_for_backward(results):
    """A larger `live_buckets` (DeepSpeed's stage3_max_live_parameters) keeps the first
    blocks gathered from forward to backward: fewer all-gathers, the same training, and
    never more gathered buckets alive than the budget."""
    model = make_model()
    psi = sum(p.numel() for p in model.parameters())
    root = sum(p.numel() for name, p in model.named_parameters() if not name.startswith("blocks."))
    block = sum(p.numel() for name, p in model.named_parameters() if name.startswith("blocks.0."))
    layers = (psi - root) // block
    for res in results:
        base_losses, base_params, _, _ = res["live", 3]
        for live, kept in ((3, 0), (5, 2), (100, layers)):
            losses, params, max_live, gathered = res["live", live]
            assert losses == base_losses
            assert all(torch.equal(params[k], base_params[k]) for k in base_params)
            assert max_live <= live
            # payload per micro-batch: every bucket once for forward, the blocks not kept again for backward
            assert gathered == 2 * 4 * (psi + (layers - kept) * block), (live, gathered)
