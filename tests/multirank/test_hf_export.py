"""fz.hf.save_pretrained at world 1 and 2 (one spawn each): tiny GPT-2 and Llama (tied and
untied) trained two steps at stage 0 and 3, fp32 and bf16, written as sharded safetensors
that `AutoModelForCausalLM.from_pretrained` loads with the very logits of fz.full_params'
weights; tied weights written once and tied again on load; the writing rank holds one
gathered bucket at a time; a failure on either rank is raised on both and leaves no folder
that loads (or the previous export whole)."""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

import fz
import fz.observe.full_params as fp
from fz.ckpt.hf.safetensors_io import StreamWriter
from fz.hf import save_pretrained
from fz.sharding.comm import Comm

from support.ranks import cached_runs
from support.real_nets import hf_loss, hf_model, tokens

pytest.importorskip("transformers")
ROWS, LIMIT = 4, 40_000  # bytes per shard: GPT-2 and Llama here are ~100-150 KB in fp32
CASES = [("gpt2", 0, "fp32"), ("gpt2", 3, "fp32"), ("llama_tied", 3, "fp32"), ("llama_tied", 0, "fp32"),
         ("llama", 3, "bf16"), ("mixtral", 3, "fp32")]  # Mixtral: experts fused in memory, saved apart


def _rows(batch: dict, rank: int, world: int) -> dict:
    return {k: v.chunk(world)[rank] for k, v in batch.items()}


def _tokenizer():
    """A word-level tokenizer made here (nothing downloaded)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(WordLevel({"[UNK]": 0, "a": 3, "b": 4}, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")


def _trained(name: str, stage: int, precision: str, rank: int, world: int):
    model = hf_model(name)
    spec = fz.Spec(stage=stage, optimizer=fz.optim.adamw(lr=1e-2), loss_fn=hf_loss, precision=precision)
    state = fz.init(model, spec)
    for i in range(2):
        state, _ = fz.train_step(state, _rows(tokens(i, world * ROWS, name), rank, world))
    return model, state


def _logits(model, name: str) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=tokens(9, 2, name)["input_ids"]).logits


def _loaded(out: Path, name: str, full: dict, dtype: torch.dtype) -> dict:
    """What rank 0 checks of a written folder: it loads, its logits, its index, its tensors."""
    from safetensors import safe_open
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    ref = hf_model(name)
    for p in ref.parameters():  # not .to(dtype): the RoPE tables stay fp32, as from_pretrained keeps them
        p.data = p.data.to(dtype)
    ref.load_state_dict(full, strict=True)
    hf = out.with_name(out.name + "-transformers")
    ref.save_pretrained(hf, max_shard_size=LIMIT)  # what transformers writes from the same weights
    theirs = json.loads((hf / "model.safetensors.index.json").read_text())
    want = {k: t for p in hf.glob("*.safetensors") for k, t in load_file(p).items()}
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    stored = {}
    for f in shards:
        with safe_open(str(out / f), framework="pt") as h:
            assert h.metadata() == {"format": "pt"}
            stored.update((k, (f, k in want and torch.equal(h.get_tensor(k), want[k]))) for k in h.keys())
    tied = loaded.config.tie_word_embeddings
    return {"equal": torch.equal(_logits(loaded, name), _logits(ref, name)), "dtype": loaded.dtype,
            "problems": {k: v for k, v in info.items() if v}, "index": index, "shards": shards,
            "stored": stored, "theirs": set(theirs["weight_map"]),
            "tied": loaded.get_output_embeddings().weight is loaded.get_input_embeddings().weight if tied else None,
            "config": json.loads((out / "config.json").read_text()),
            "generation": (out / "generation_config.json").exists(), "hidden": [p.name for p in out.glob(".*")],
            "tokens": AutoTokenizer.from_pretrained(out)("a b c").input_ids if name == "gpt2" else None}


class _Peak:
    """On the writing rank: the most buckets with a gathered tensor alive at any write (storages
    are watched: a view keeps its storage, not its Python object), and the largest gather."""

    def __init__(self) -> None:
        self.live: list[list[StorageWeakRef]] = []  # per bucket, its tensors' storages
        self.most_live = self.largest = 0

    def __enter__(self) -> _Peak:
        self.gather, self.whole, self.write = Comm.all_gather, fp._whole, StreamWriter.write
        peak = self

        def all_gather(comm, out, inp, *a, **k):
            peak.largest = max(peak.largest, out.numel())
            return peak.gather(comm, out, inp, *a, **k)

        def whole(*a, **k):
            tensors = peak.whole(*a, **k)
            peak.live.append([StorageWeakRef(t.untyped_storage()) for t in tensors])
            return tensors

        def write(w, name, t):
            peak.most_live = max(peak.most_live, sum(any(not r.expired() for r in b) for b in peak.live))
            return peak.write(w, name, t)

        Comm.all_gather, fp._whole, StreamWriter.write = all_gather, whole, write  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc) -> None:
        Comm.all_gather, fp._whole, StreamWriter.write = self.gather, self.whole, self.write  # type: ignore[method-assign]


def _failing(cls_or_mod, attr: str, after: int, exc: Exception):
    """Patch `attr` to raise `exc` from its `after`+1-th call; returns the undo."""
    orig, calls = getattr(cls_or_mod, attr), [0]

    def patched(*a, **k):
        calls[0] += 1
        if calls[0] > after:
            raise exc
        return orig(*a, **k)

    setattr(cls_or_mod, attr, patched)
    return lambda: setattr(cls_or_mod, attr, orig)


def _failure(state, model, out: Path, rank: int, world: int, who: int, what: str) -> dict:
    """One export with `what` failing on rank `who`: the error each rank raised, and what loads."""
    undo = lambda: None  # noqa: E731
    if rank == who:
        undo = (_failing(StreamWriter, "write", 2, OSError("injected write error")) if what == "write" else
                _failing(fp, "load", 1, OSError("injected read error")))
    try:
        save_pretrained(state, out, model=model, max_shard_size=LIMIT)
        err = None
    except Exception as e:  # noqa: BLE001 - what each rank raised is the result
        err = f"{type(e).__name__}: {e}"
    finally:
        undo()
    res: dict = {"err": err}
    if rank == 0:
        from transformers import AutoModelForCausalLM
        res["files"] = sorted(p.name for p in out.iterdir()) if out.exists() else []
        try:
            res["logits"] = _logits(AutoModelForCausalLM.from_pretrained(out), "gpt2")
        except (OSError, ValueError) as e:
            res["logits"] = f"{type(e).__name__}: {e}"
    return res


def _checks(rank: int, world: int, tmp: str) -> dict:
    warnings.filterwarnings("ignore")
    out: dict = {}
    for name, stage, precision in CASES:
        model, state = _trained(name, stage, precision, rank, world)
        where = Path(tmp) / f"w{world}-{name}-{stage}-{precision}"
        with _Peak() as peak:
            info = save_pretrained(state, where, model=model, max_shard_size=LIMIT if stage else "40KB",
                                   processing_class=_tokenizer() if name == "gpt2" else None)
        bf16 = precision == "bf16"
        full = fz.full_params(state, "compute" if bf16 else None)
        res = {"info": info, "live": peak.most_live, "largest": peak.largest,
               "numel": sum(t.numel() for t in full.values())}
        if rank == 0:
            res.update(_loaded(where, name, full, torch.bfloat16 if bf16 else torch.float32))
        out[name, stage, precision] = res
    if world == 2:  # failures: on the writing rank (a write), on the other (a disk-tier read); then a save works
        model, state = _trained("gpt2", 3, "fp32", rank, world)
        base = Path(tmp) / "fail"
        out["write"] = _failure(state, model, base / "fresh", rank, world, 0, "write")
        out["read"] = _failure(state, model, base / "read", rank, world, 1, "read")
        save_pretrained(state, base / "kept", model=model, max_shard_size=LIMIT)
        out["kept"] = _failure(state, model, base / "kept", rank, world, 0, "write")
        out["after"] = _failure(state, model, base / "after", rank, world, -1, "none")
        ref = hf_model("gpt2")
        ref.load_state_dict(fz.full_params(state), strict=True)
        out["want"] = _logits(ref, "gpt2")
    return out


@pytest.fixture(scope="module", params=[1, 2], ids=lambda w: f"world{w}")
def results(request, tmp_path_factory):
    return request.param, cached_runs(request.param, _checks, str(tmp_path_factory.mktemp("export")), timeout=400)


def test_from_pretrained_gives_the_logits_of_full_params(results):
    world, ranks = results
    for case in CASES:
        r = ranks[0][case]
        assert r["equal"], case
        assert r["problems"] == {}, case  # no missing, unexpected or mismatched keys
        assert r["dtype"] == (torch.bfloat16 if case[2] == "bf16" else torch.float32), case
        assert r["config"]["dtype"] == ("bfloat16" if case[2] == "bf16" else "float32"), case
        assert r["generation"] and r["hidden"] == [], case
        assert all(equal for _, equal in r["stored"].values()), case
        assert r["tokens"] == ([3, 4, 0] if case[0] == "gpt2" else None), case  # the tokenizer given is saved


def test_index_maps_every_tensor_to_its_shard(results):
    world, ranks = results
    for case in CASES:
        r, info = ranks[0][case], ranks[0][case]["info"]
        index = r["index"]
        assert set(index) == {"metadata", "weight_map"} and len(r["shards"]) >= 2, case
        assert {k: f for k, (f, _) in r["stored"].items()} == index["weight_map"], case
        assert set(index["weight_map"].values()) == set(r["shards"]), case
        assert r["shards"] == [f"model-{i:05d}-of-{len(r['shards']):05d}.safetensors"
                               for i in range(1, len(r["shards"]) + 1)], case
        assert index["metadata"]["total_size"] == info.bytes, case
        assert set(index["weight_map"]) == r["theirs"], case  # the names transformers' save_pretrained writes
        assert info.files == (*r["shards"], "model.safetensors.index.json"), case
        assert all(rk[case]["info"] == info for rk in ranks), case  # every rank returns the same


def test_tied_weights_are_written_once_and_tied_on_load(results):
    world, ranks = results
    for case in CASES:
        r = ranks[0][case]
        tied = case[0] in ("gpt2", "llama_tied")
        assert r["tied"] is (True if tied else None), case
        head = "lm_head.weight"
        assert (head in r["index"]["weight_map"]) is (not tied), case


def test_the_writer_holds_one_gathered_bucket_at_a_time(results):
    world, ranks = results
    for case in CASES:
        r = ranks[0][case]
        if world == 2 and case[1] == 3:
            assert r["live"] == 1 and 0 < r["largest"] < r["numel"], (case, r["live"], r["largest"], r["numel"])
        else:  # stage 0, or one rank: nothing is gathered, the tensors written are views of the state's own
            assert r["largest"] == 0, case


def test_a_failure_on_either_rank_is_raised_on_both_and_nothing_half_written_loads(results):
    world, ranks = results
    if world == 1:
        pytest.skip("the failure checks run at world 2")
    for what, who in (("write", 0), ("read", 1)):
        errs = [ranks[r][what]["err"] for r in range(2)]
        assert f"injected {what} error" in errs[who], errs
        assert errs[1 - who].startswith("CheckpointError") and f"failed on rank {who}" in errs[1 - who], errs
        assert ranks[0][what]["files"] == [], ranks[0][what]  # not even the hidden folder is left
        assert isinstance(ranks[0][what]["logits"], str), what
    kept = ranks[0]["kept"]  # a failed export over an earlier one: the earlier one is untouched and loads
    assert kept["err"] and torch.equal(kept["logits"], ranks[0]["want"])
    assert not any(f.startswith(".") for f in kept["files"])
    after = ranks[0]["after"]  # the state is still usable: the next export succeeds
    assert after["err"] is None and torch.equal(after["logits"], ranks[0]["want"])


def test_fp32_masters_of_a_bf16_run_in_one_file_and_argument_errors(tmp_path):
    """One process: dtype=torch.float32 writes the masters (zero_to_fp32's weights); under the
    shard size, one model.safetensors and no index, as transformers writes; bad arguments name the cause."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    warnings.filterwarnings("ignore")
    model, state = _trained("llama", 0, "bf16", 0, 1)
    info = save_pretrained(state, tmp_path / "fp32", dtype=torch.float32)  # the model: the state's own
    assert info.files == ("model.safetensors",) and info.dtype == "float32"
    assert sorted(p.name for p in (tmp_path / "fp32").iterdir()) == ["config.json", "generation_config.json",
                                                                     "model.safetensors"]
    full = fz.full_params(state)  # the fp32 masters
    stored = load_file(tmp_path / "fp32" / "model.safetensors")
    assert stored.keys() == full.keys() and all(torch.equal(stored[n], full[n]) for n in full)
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "fp32").dtype == torch.float32
    for kw, words in (({"max_shard_size": "lots"}, "max_shard_size='lots'"), ({"max_shard_size": 0}, "positive"),
                      ({"dtype": torch.int8}, "floating torch.dtype")):
        with pytest.raises(fz.ConfigError, match=words):
            save_pretrained(state, tmp_path / "bad", model=model, **kw)
    with pytest.raises(fz.ConfigError, match="the model has parameters the state does not"):
        save_pretrained(state, tmp_path / "bad", model=torch.nn.Linear(2, 2))  # not the state's model
    assert not (tmp_path / "bad").exists()
