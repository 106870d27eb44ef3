"""Jobs for tests/multirank/test_generate.py: fz.generate against HF's own generate on the whole
model, per rank, at stages 0 and 3 with each residency plan; sampling; generate between train
steps; a call on one rank only. Every check of a world runs in one spawn."""
from __future__ import annotations

import time
import warnings

import torch

import fz
from fz.sharding.gather import Gatherer

PLANS = ("gather", "stream", 1, "auto")
IDS = dict(pad_token_id=0, eos_token_id=1, bos_token_id=2)


def tiny(name: str, seed: int = 0) -> torch.nn.Module:
    """Llama or GPT-2, 2 layers, hidden 32, room for 64 positions (a finished rank keeps decoding)."""
    import transformers as tr
    torch.manual_seed(seed)
    if name == "gpt2":
        m = tr.GPT2LMHeadModel(tr.GPT2Config(vocab_size=64, n_positions=64, n_embd=32, n_layer=2, n_head=2,
                                             resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **IDS))
    else:
        m = tr.LlamaForCausalLM(tr.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                               num_attention_heads=2, num_key_value_heads=1,
                                               max_position_embeddings=64, **IDS))
    return m.eval()


def prompts(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts of different lengths, different on each rank (rank 1's are longer)."""
    g = torch.Generator().manual_seed(10 + rank)
    lengths = [2 + rank, 5 + rank, 4]
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, width - n:] = torch.randint(3, 64, (n,), generator=g)
    return ids, (ids != 0).long()


def _gathers() -> list[int]:
    """Counts Gatherer.gather calls (this process only)."""
    count = [0]
    plain = Gatherer.gather

    def counted(self, bucket, shard):
        count[0] += 1
        return plain(self, bucket, shard)

    Gatherer.gather = counted  # type: ignore[method-assign]
    return count


def greedy(rank: int, world: int) -> dict:
    """Greedy output per (model, stage, plan) against HF on the whole model; rank 1 asks for
    fewer tokens, so it finishes first and must keep pace. Gathers counted per call."""
    warnings.filterwarnings("ignore")
    count, out = _gathers(), {}
    ids, mask = prompts(rank)
    new = 8 if rank == 0 else 3
    for name in ("llama", "gpt2"):
        want = tiny(name).generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False)
        eos = dict(eos_token_id=int(want[1, ids.shape[1] + 1]))  # the second row stops after its 2nd token
        want_eos = tiny(name).generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, **eos)
        for stage in (0, 3):
            state = fz.init(tiny(name), fz.Spec(stage=stage))
            out[name, stage, "buckets"] = sum(b.sharded_param for b in state.plan.buckets)
            for plan in PLANS:
                count[0] = 0
                got = fz.generate(state, ids, mask, residency=plan, max_new_tokens=new, do_sample=False)
                out[name, stage, plan] = (torch.equal(got, want), count[0])
            got = fz.generate(state, ids, mask, residency="stream", max_new_tokens=new, do_sample=False, **eos)
            out[name, stage, "eos"] = torch.equal(got, want_eos)
    out["forwards"] = new  # forwards of this rank's own decode
    return out


def sampling(rank: int, world: int) -> dict:
    """Sampling with a seed: the same prompts on every rank give the same tokens, twice, equal to
    HF's with that seed; the caller's generator is untouched."""
    warnings.filterwarnings("ignore")
    ids, mask = prompts(0)
    kw = dict(max_new_tokens=6, do_sample=True, top_k=20, temperature=1.5)
    model = tiny("llama")
    torch.manual_seed(7)
    want = model.generate(ids, attention_mask=mask, **kw)
    out = {}
    state = fz.init(tiny("llama"), fz.Spec(stage=3))
    torch.manual_seed(123)
    before = torch.get_rng_state()
    out["first"] = fz.generate(state, ids, mask, seed=7, residency="gather", **kw)
    out["again"] = fz.generate(state, ids, mask, seed=7, residency="stream", **kw)
    out["hf"] = torch.equal(out["first"], want)
    out["rng_kept"] = torch.equal(before, torch.get_rng_state())
    return out


def mid_training(rank: int, world: int) -> dict:
    """Losses of 4 train steps with fz.generate (and eval_step with a plan) after the 2nd equal
    those without; the parameters after them too."""
    warnings.filterwarnings("ignore")
    g = torch.Generator().manual_seed(5)
    batches = [torch.randint(3, 64, (2 * world, 8), generator=g) for _ in range(4)]
    ids, mask = prompts(rank)
    out = {}
    for stage in (0, 3):
        runs = []
        for with_generate in (False, True):
            state = fz.init(tiny("llama"), fz.Spec(stage=stage, optimizer=fz.optim.adamw(lr=1e-2)))
            losses = []
            for i, b in enumerate(batches):
                mine = b.chunk(world)[rank]
                state, loss = fz.train_step(state, {"input_ids": mine, "labels": mine})
                losses.append(float(loss))
                if i == 1 and with_generate:
                    fz.generate(state, ids, mask, max_new_tokens=4, do_sample=True, seed=1)
                    fz.generate(state, ids, mask, max_new_tokens=4, residency="gather")
                    fz.evaluate(state, [{"input_ids": mine, "labels": mine}] * 2, residency="gather")
            runs.append((losses, {k: v.clone() for k, v in fz.full_params(state).items()}))
        (a, pa), (b, pb) = runs
        out[stage] = (a == b, all(torch.equal(pa[k], pb[k]) for k in pa), a)
    return out


def evaluation(rank: int, world: int) -> dict:
    """fz.evaluate over 3 batches equals eval_step on each, gathering each bucket once ("gather")
    or per batch ("stream"); eval_step and apply with a plan equal them without."""
    warnings.filterwarnings("ignore")
    count, out = _gathers(), {}
    g = torch.Generator().manual_seed(20 + rank)
    batches = [{"input_ids": b, "labels": b} for b in torch.randint(3, 64, (3, 2, 8), generator=g)]
    state = fz.init(tiny("llama"), fz.Spec(stage=3))
    out["buckets"] = sum(b.sharded_param for b in state.plan.buckets)
    want = [fz.eval_step(state, b) for b in batches]
    for plan in ("gather", "stream", "auto"):
        count[0] = 0
        got = fz.evaluate(state, batches, residency=plan)
        out[plan] = ([torch.equal(a, b) for a, b in zip(got, want)], count[0])
    out["eval_step"] = torch.equal(fz.eval_step(state, batches[0], residency="gather"), want[0])
    x = batches[0]["input_ids"]
    out["apply"] = torch.equal(fz.apply(state, x, residency="stream").logits, fz.apply(state, x).logits)
    return out


def one_rank(rank: int, world: int) -> dict:
    """Stage 3: rank 0 calls fz.generate alone (fails fast) while rank 1 goes on to its train step;
    stage 0: it may (local)."""
    warnings.filterwarnings("ignore")
    ids, mask = prompts(0)
    out = {}
    for stage in (3, 0):
        state = fz.init(tiny("llama"), fz.Spec(stage=stage, timeout_s=30.0))
        if rank == 0:
            t0 = time.monotonic()
            try:
                got = fz.generate(state, ids, mask, max_new_tokens=3, do_sample=False)
                out[stage] = ("", time.monotonic() - t0, got)
            except fz.ConfigError as e:
                out[stage] = (str(e), time.monotonic() - t0, None)
        state, loss = fz.train_step(state, {"input_ids": ids, "labels": ids})  # the ranks pair up again
        out[stage, "loss"] = float(loss)
    return out


def all_checks(rank: int, world: int) -> dict:
    return {"greedy": greedy(rank, world), "sampling": sampling(rank, world),
            "mid_training": mid_training(rank, world),
            "evaluation": evaluation(rank, world), "one_rank": one_rank(rank, world) if world > 1 else {}}
