"""A checkpoint whose files are well formed but whose values are not what a run writes: restore
refuses it, naming the file and the value, and the template it loaded into is given up. A data or
client tree pointing at a weight (which would leave the weight unrestored), a file the manifest
does not list, a step count below 0 or a negative mean of squares (NaN in the weights at the
next step), a generator state that is not one, a record repeating its elements (a stride of 0:
gigabytes from a few bytes)."""
from __future__ import annotations

import json
import logging
import os

import pytest
import torch

import fz
from fz.ckpt import manifest
from fz.ckpt.chunk import read_chunk
from fz.errors import CheckpointError, ConfigError

from support.helpers import make_model, rank_batches, spec


def _trained() -> fz.State:
    state = fz.init(make_model(), spec(1, 1))
    state, _ = fz.train_step(state, rank_batches(1, 1, 1)[0][0])
    return state


def _relist(step, name: str) -> None:
    files = manifest.read(step)
    files.update(manifest.describe(step, [name]))
    manifest.write(step, files)


def _restore(path) -> None:
    template = fz.init(make_model(1), spec(1, 1))
    with pytest.raises(CheckpointError) as caught:
        fz.restore(template, path)
    with pytest.raises(ConfigError, match="was donated to fz.restore"):
        fz.train_step(template, rank_batches(1, 1, 1)[0][0])
    raise caught.value


@pytest.mark.parametrize("where", ["data", "client"])
def test_a_tree_pointing_at_a_weight_is_refused(tmp_path, where):
    state = _trained()
    fz.save(state, tmp_path, client_state={"note": torch.ones(2)})
    step = tmp_path / "step_1"
    name = "data_0.json" if where == "data" else "fz.json"
    doc = json.loads((step / name).read_text())
    weight = {"__fz_tensor__": "model/" + next(iter(state.params))}
    if where == "data":
        doc["data"] = {"x": weight}
    else:
        doc["client_state"] = {"note": weight}
    (step / name).write_text(json.dumps(doc))
    _relist(step, name)
    with pytest.raises(CheckpointError, match=rf"{name} refers to tensor 'model/.*', which is not one of its own"):
        fz.restore(fz.init(make_model(1), spec(1, 1)), step)


def _nested(depth: int, leaf):
    tree = leaf
    for i in range(depth - 1):
        tree = (tree,) if i % 2 else {"k": tree}
    return tree


@pytest.mark.parametrize("where", ["data", "client"])
def test_a_tree_nested_past_what_save_writes_is_refused_before_it_is_walked(tmp_path, where):
    """fz.save writes trees up to MAX_DEPTH deep (tuples and tensors encoded one level deeper), and
    restore reads them back; one nested 900 deep in the file (under json's own limit) is a
    CheckpointError naming the file, not a RecursionError from the walk."""
    from fz.ckpt.tree import MAX_DEPTH
    state = _trained()
    deepest = _nested(MAX_DEPTH, torch.ones(2))
    fz.save(state, tmp_path / "ok", client_state={"deep": deepest})
    _, client = fz.restore(fz.init(make_model(1), spec(1, 1)), tmp_path / "ok", with_client_state=True)
    assert str(client["deep"]) == str(deepest)
    with pytest.raises(ConfigError, match=f"nests deeper than {MAX_DEPTH} levels"):
        fz.save(state, tmp_path / "no", client_state={"deep": _nested(MAX_DEPTH + 1, 1)})
    fz.save(state, tmp_path / "bad", client_state={"x": 1})
    step = tmp_path / "bad" / "step_1"
    name = "data_0.json" if where == "data" else "fz.json"
    doc = json.loads((step / name).read_text())
    deep = json.loads("[" * 900 + "]" * 900)
    doc["data" if where == "data" else "client_state"] = deep if where == "data" else {"x": deep}
    (step / name).write_text(json.dumps(doc))
    _relist(step, name)
    with pytest.raises(CheckpointError, match=rf"{name}: its {where} tree nests deeper than"):
        fz.restore(fz.init(make_model(1), spec(1, 1)), step)


def test_a_file_the_manifest_does_not_list_is_not_read(tmp_path):
    fz.save(_trained(), tmp_path)
    step = tmp_path / "step_1"
    files = manifest.read(step)
    del files["data_0.json"]
    manifest.write(step, files)
    with pytest.raises(CheckpointError, match="its manifest lists no data_0.json"):
        fz.restore(fz.init(make_model(1), spec(1, 1)), step)


@pytest.mark.parametrize("what", ["count", "wrap", "nu", "mu"])
def test_impossible_optimizer_values_are_refused_and_the_template_given_up(tmp_path, what):
    """A negative count or nu made NaN weights after one step; a finite mu of 3e38 made inf ones; a
    count of 2**63-1 wrapped to -2**63 at the next step (every weight NaN, a schedule's lr -9e15)."""
    state = _trained()
    adam = state.opt_state[0]
    if what in ("count", "wrap"):
        adam.count.fill_(-1 if what == "count" else 2**63 - 1)
    elif what == "nu":
        next(iter(adam.nu.values())).view(-1)[0] = -1.0
    else:
        next(iter(adam.mu.values())).view(-1)[0] = 3e38
    fz.save(state, tmp_path)
    words = {"count": r"opt/0/count = -1 \(a step count: from 0 to 2\*\*48\)",
             "wrap": r"opt/0/count = 9223372036854775807 \(a step count: from 0 to 2\*\*48\)",
             "nu": r"opt/0/nu/.* has 1 negative values",
             "mu": r"opt/0/mu/.* has 1 values over 1e\+30 x the square root of nu's"}[what]
    with pytest.raises(CheckpointError, match=rf"values no run writes, .*NaN .*{words}"):
        _restore(tmp_path / "step_1")


@pytest.mark.parametrize("field, value", [("scale", float("nan")), ("scale", float("inf")), ("scale", 0.0),
                                          ("scale", -65536.0), ("iter", -5), ("skipped", -1),
                                          ("iter", 2**63 - 1), ("hysteresis", 0)])
def test_an_impossible_loss_scale_is_refused(tmp_path, field, value):
    """fp16: a NaN or inf scale skipped every later step silently, 0 divided by zero at the next
    step, a negative one was taken; a negative count is no count; hysteresis 0 never halved the
    scale (every step skipped). The DeepSpeed import refused them."""
    state = fz.init(make_model(), spec(1, 1, precision="fp16"))
    state, _ = fz.train_step(state, rank_batches(1, 1, 1)[0][0])
    bad = dict(state.scaler, **{field: torch.tensor(value, dtype=state.scaler[field].dtype)})
    fz.save(state.replace(scaler=bad), tmp_path)
    template = fz.init(make_model(1), spec(1, 1, precision="fp16"))
    with pytest.raises(CheckpointError, match=rf"loss-scale values no run writes.*scaler/{field} = "):
        fz.restore(template, tmp_path / "step_1")


def test_a_generator_state_that_is_not_one_is_refused(tmp_path):
    fz.save(_trained().replace(rng=torch.zeros(4)), tmp_path)
    with pytest.raises(CheckpointError, match=r"rng/0 is torch.float32 of size \[4\], not a generator's state"):
        fz.restore(fz.init(make_model(1), spec(1, 1)), tmp_path / "step_1")


@pytest.mark.parametrize("left, position", [(0, 0), (624, 624), (1, 5000)])
def test_a_generator_position_no_generator_reaches_is_refused(tmp_path, left, position):
    """Of the right size, but all zeros (torch's own check: a bare RuntimeError at the next step), or a
    position past the Mersenne Twister's 624 words (torch takes it, and its draws read memory beyond
    them)."""
    import struct
    raw = bytearray(torch.get_rng_state().numpy().tobytes())
    struct.pack_into("<iiQ", raw, 8, left, 1 if left else 0, position)
    fz.save(_trained().replace(rng=torch.frombuffer(raw, dtype=torch.uint8).clone()), tmp_path)
    with pytest.raises(CheckpointError, match=rf"rng/0, this rank's generator state: its Mersenne Twister position "
                                              rf"\(left {left}, next {position}"):
        fz.restore(fz.init(make_model(1), spec(1, 1)), tmp_path / "step_1")


def test_a_record_repeating_its_elements_is_not_expanded(tmp_path):
    f = tmp_path / "__0_0.distcp"
    torch.save(torch.ones(1).expand(10**8), f)  # one stored float, 10**8 claimed (stride 0)
    with pytest.raises(CheckpointError, match=r"size \[100000000\] holds more elements than its storage's 1"):
        read_chunk(f, 0, f.stat().st_size, torch.float32, (10**8,))


def test_consolidate_hf_copies_no_config_or_tokenizer_from_outside_the_folder(tmp_path):
    """A Trainer checkpoint whose config.json links to a file elsewhere (or /proc/self/environ):
    the export refuses it rather than copy the secret into a folder users publish."""
    from fz.ckpt.export import consolidate
    fz.save(_trained(), tmp_path / "checkpoint-1" / "fz")
    secret = tmp_path / "secret.txt"
    secret.write_text("CANARY")
    (tmp_path / "checkpoint-1" / "config.json").symlink_to(secret)
    (tmp_path / "checkpoint-1" / "trainer_state.json").write_text("{}")  # a Trainer's: its files are looked at
    with pytest.raises(CheckpointError, match=r"config.json .*outside|outside .*config.json"):
        consolidate(tmp_path / "checkpoint-1" / "fz", tmp_path / "out", hf=True)
    assert not any("CANARY" in p.read_text(errors="ignore") for p in (tmp_path / "out").glob("*") if p.is_file())


@pytest.mark.parametrize("name", ["manifest.json", "index.json", "fz.json", "data_0.json"])
def test_a_metadata_file_claiming_gigabytes_is_not_read(tmp_path, name):
    """A sparse metadata file of 300 MB (a few bytes on disk; listed in the manifest as such) is
    refused by its size, not allocated."""
    fz.save(_trained(), tmp_path)
    os.truncate(tmp_path / "step_1" / name, 300 << 20)
    if name != "manifest.json":
        _relist(tmp_path / "step_1", name)
    with pytest.raises(CheckpointError, match=rf"{name} is 314572800 bytes, over the 256 MiB"):
        fz.restore(fz.init(make_model(1), spec(1, 1)), tmp_path / "step_1")


@pytest.mark.parametrize("where", ["fz.json", "data_0.json"])
def test_a_save_fz_restore_would_not_read_back_is_refused(tmp_path, monkeypatch, where):
    """fz.save refuses a metadata file over the cap restore reads (1 MiB here, 256 MiB really), as a
    CheckpointError naming it, rather than committing a checkpoint that cannot be restored."""
    from fz.ckpt import saver
    monkeypatch.setattr(saver, "JSON_MAX", 1 << 20)
    state, big = _trained(), {"note": "x" * (1 << 20)}
    if where == "data_0.json":
        state = state.replace(data=big)
    with pytest.raises(CheckpointError, match=rf"fz.save: {where} would be 10\d{{5}} bytes, over the 1 MiB fz.restore "
                       "reads of a metadata file"):
        fz.save(state, tmp_path, client_state=big if where == "fz.json" else None)
    assert not (tmp_path / "latest").exists()


@pytest.mark.parametrize("entry", [{"checksum": "x", "algorithm": "xxh3"}, {"size": "12", "checksum": "x",
                                                                            "algorithm": "xxh3"}])
def test_a_manifest_entry_without_a_size_is_named(tmp_path, entry):
    fz.save(_trained(), tmp_path)
    step = tmp_path / "step_1"
    files = manifest.read(step)
    files["fz.json"] = {**files["fz.json"], **entry}
    if "size" not in entry:
        del files["fz.json"]["size"]
    manifest.write(step, files)
    with pytest.raises(CheckpointError, match=r"lists 'fz.json' with size .*: not a size in bytes and a checksum"):
        fz.restore(fz.init(make_model(1), spec(1, 1)), step)


@pytest.mark.parametrize("entry", [["algorithm"], {"size": 12, "checksum": "x", "algorithm": "md5"}])
def test_a_manifest_entry_that_is_not_an_object_of_a_known_algorithm_is_named(tmp_path, entry):
    """A list where an entry should be was a bare TypeError, worded as the manifest being unreadable;
    an unknown algorithm, as its own checksum not matching."""
    fz.save(_trained(), tmp_path)
    step = tmp_path / "step_1"
    manifest.write(step, {**manifest.read(step), "fz.json": entry})
    with pytest.raises(CheckpointError, match=r"manifest.json lists 'fz.json' as .*: not an object with a checksum "
                       r"algorithm fz knows \(xxh3, crc32, sha256\)"):
        fz.restore(fz.init(make_model(1), spec(1, 1)), step)


@pytest.mark.parametrize("epoch, index", [(0, -3), (-3, 0), (0, 10**6), (True, 0)])
def test_a_saved_data_position_out_of_range_is_named(epoch, index):
    state = fz.init(make_model(), spec(0, 1))
    rows = list(range(40))
    position = {**fz.data.loader(rows, state, micro_batch=4).state_dict(), "epoch": epoch, "index": index}
    state = state.replace(data={"loader": position})
    with pytest.raises(ConfigError, match=r"is epoch .*, index .*: not an epoch >= 0 and a sample index from 0 to 40"):
        fz.data.loader(rows, state, micro_batch=4)


def test_an_iterable_datasets_position_past_what_the_step_read_is_refused():
    """Resuming reads past the saved index one sample at a time: 2**62 at step 1 read an endless
    stream for ever. A position the state's updates can have reached (with room for a run of more
    rows per step) still resumes."""

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(10**9))

    state = _trained()  # step 1
    reachable = {**fz.data.loader(Stream(), spec(0, 1), micro_batch=4).state_dict(), "index": 4 * 2 * 1024}
    assert fz.data.loader(Stream(), state.replace(data={"loader": reachable}), micro_batch=4).state_dict() == reachable
    state = state.replace(data={"loader": {**reachable, "index": 2**62}})
    with pytest.raises(ConfigError, match=r"is at sample 4611686018427387904, but the state is at step 1, which reads "
                                          r"at most 8 samples of 4 a step .*: damaged or altered"):
        fz.data.loader(Stream(), state, micro_batch=4)


def test_a_step_that_is_not_the_one_fz_json_names_is_refused(tmp_path):
    """The data position is bounded by the step: a crafted step (2**40, with a position of 2**50
    samples) read past an iterable stream for ever; fz.json's train_step must agree with it."""
    fz.save(_trained(), tmp_path)
    step = tmp_path / "step_1"
    doc = json.loads((step / "fz.json").read_text())
    doc["train_step"] = 2**40
    (step / "fz.json").write_text(json.dumps(doc))
    _relist(step, "fz.json")
    with pytest.raises(CheckpointError, match=r"values no run writes, .*: step = 1, where fz.json says train_step = "
                                              r"1099511627776\. Damaged"):
        _restore(step)


def test_reading_past_an_iterable_datasets_used_samples_says_so(monkeypatch, caplog):
    """A resume of an iterable dataset reads past the samples used (as long as reading them takes):
    it says so as it starts, and how far it is as it goes, not silently."""
    from fz.data import steps

    monkeypatch.setattr(steps, "SAY_EVERY_S", 0.0)

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(10**6))

    state = _trained()
    position = {**fz.data.loader(Stream(), spec(0, 1), micro_batch=4).state_dict(), "index": 8000}
    loader = fz.data.loader(Stream(), state.replace(data={"loader": position}), micro_batch=4)
    with caplog.at_level(logging.INFO, logger="fz.data.steps"):
        assert next(iter(loader)).tolist()[0] == 8000
    said = [r.getMessage() for r in caplog.records if r.name == "fz.data.steps"]
    assert said[0] == ("fz.data: resuming an iterable dataset at sample 8000 of epoch 0: reading past the samples "
                       "before it")
    assert said[-1] == "fz.data: read past 7996 of 7996 samples"  # the first 4 kept, to fill a last step


@pytest.mark.parametrize("field", ["seed", "shuffle", "size", "format"])
def test_a_saved_data_position_holding_a_tensor_is_named(field):
    """A data_N.json may refer to its own tensors: one in the position was a bare RuntimeError (a
    tensor of two values has no one truth), not a ConfigError naming the position."""
    state = fz.init(make_model(), spec(0, 1))
    rows = list(range(40))
    position = {**fz.data.loader(rows, state, micro_batch=4).state_dict(), field: torch.tensor([1, 40])}
    state = state.replace(data={"loader": position})
    words = ("is not a position fz.data wrote" if field == "format"
             else rf"has {field}=tensor\(\[ 1, 40\]\), not a number")
    with pytest.raises(ConfigError, match=rf"fz.data: .*state.data\['loader'\] {words}"):
        fz.data.loader(rows, state, micro_batch=4)


@pytest.mark.parametrize("lie", ["values", "overlap", "past_end"])
def test_an_index_is_bounded_by_the_bytes_on_disk(tmp_path, lie):
    """What restore allocates from index.json is bounded by the files: a chunk holds no more values
    than its record's bytes, records do not share bytes, and none reaches past its file's end."""
    fz.save(_trained(), tmp_path)
    step = tmp_path / "step_1"
    index = json.loads((step / "index.json").read_text())
    chunks = [(k, c) for k, t in index["tensors"].items() for c in t["chunks"]]
    key, first = next((k, c) for k, c in chunks if index["tensors"][k]["size"])
    if lie == "values":
        t = index["tensors"][key]
        t["size"] = [n * 1000 for n in t["size"][:1]] + t["size"][1:]
        for c in t["chunks"]:
            c["offsets"] = [o * 1000 for o in c["offsets"][:1]] + c["offsets"][1:]
            c["sizes"] = [n * 1000 for n in c["sizes"][:1]] + c["sizes"][1:]
        words = r"values in a record of \d+ bytes"
    elif lie == "overlap":
        other = next(c for _, c in chunks if c is not first and c["file"] == first["file"])
        other["at"] = first["at"]
        words = "overlaps another's record"
    else:
        last = max((c for _, c in chunks if c["file"] == first["file"]), key=lambda c: c["at"])
        last["length"] += (step / first["file"]).stat().st_size
        words = r"past its \d+ bytes"
    (step / "index.json").write_text(json.dumps(index))
    _relist(step, "index.json")
    with pytest.raises(CheckpointError, match=words):
        fz.restore(fz.init(make_model(1), spec(1, 1)), step)


def test_a_tensor_of_more_chunks_than_ranks_is_refused_before_they_are_planned(tmp_path):
    """A tensor split into more chunks than any run has ranks (2**17 + 1 here) is refused by their
    count, before each is checked or DCP plans them (100k chunks took 23 s and a gigabyte)."""
    fz.save(_trained(), tmp_path)
    step = tmp_path / "step_1"
    index = json.loads((step / "index.json").read_text())
    key, t = next((k, t) for k, t in index["tensors"].items() if t["size"])
    t["chunks"] = t["chunks"][:1] * ((1 << 17) + 1)
    (step / "index.json").write_text(json.dumps(index))
    _relist(step, "index.json")
    with pytest.raises(CheckpointError, match=rf"index.json is unreadable or damaged \(ValueError: '{key}': 131073 "
                       r"chunks, more than the 131072 of a tensor fz.save writes \(one per rank"):
        fz.restore(fz.init(make_model(1), spec(1, 1)), step)


@pytest.mark.parametrize("name, key", [("fz.json", "train_step"), ("index.json", "format")])
def test_a_key_written_twice_is_refused(tmp_path, name, key):
    """json.loads keeps the last of a repeated key silently: a second train_step, or a second entry
    for a tensor, after the one checked. fz never writes one twice."""
    fz.save(_trained(), tmp_path)
    step = tmp_path / "step_1"
    text = (step / name).read_text()
    assert text.startswith("{")
    (step / name).write_text("{" + json.dumps(key) + ": 0, " + text[1:])
    _relist(step, name)
    with pytest.raises(CheckpointError, match=rf"{name} is unreadable.*the key '{key}' appears twice"):
        fz.restore(fz.init(make_model(1), spec(1, 1)), step)


def test_an_update_count_past_2_48_is_refused(tmp_path):
    """A step of 2**63-1 was restored and wrapped to -2**63 at the next update (every later save then
    failed, naming step=None)."""
    state = _trained()
    fz.save(state.replace(step=torch.full_like(state.step, 2**63 - 1)), tmp_path)
    with pytest.raises(CheckpointError, match=r"is damaged: it is not an object with a train_step from 0 to 2\*\*48"):
        fz.restore(fz.init(make_model(1), spec(1, 1)), tmp_path)


class _Normed(torch.nn.Module):
    """A BatchNorm's running statistics (NaN poisons them) and an integer count, whose dtype `count` sets."""

    def __init__(self, count: torch.dtype = torch.int64):
        super().__init__()
        self.lin, self.norm = torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)
        self.norm.num_batches_tracked = torch.tensor(0, dtype=count)

    def forward(self, x):
        return self.norm(self.lin(x)).sum()


def _normed(count: torch.dtype = torch.int64) -> fz.State:
    return fz.init(_Normed(count), fz.Spec(stage=0, optimizer=fz.optim.adamw(lr=1e-3), loss_fn=lambda m, x: m(x)))


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_nan_running_statistic_is_refused_a_masks_inf_is_not(tmp_path, value):
    """A NaN or +inf buffer was restored silently (the same values from a weights folder were refused);
    -inf, a mask's, restores."""
    state = _normed()
    state.buffers["norm.running_var"][1] = value
    fz.save(state, tmp_path / "bad")
    with pytest.raises(fz.NonFiniteError, match=r"holds NaN or inf in 1 tensors \(1 values\): buffer "
                                                r"'norm.running_var' 1 of 4"):
        fz.restore(_normed(), tmp_path / "bad")
    state.buffers["norm.running_var"][1] = float("-inf")
    fz.save(state, tmp_path / "mask")
    assert bool(torch.isneginf(fz.restore(_normed(), tmp_path / "mask").buffers["norm.running_var"][1]))


def test_a_float_for_an_integer_buffer_is_refused(tmp_path):
    """A NaN landed as -2**63 in num_batches_tracked."""
    state = _normed(torch.float32)
    state.buffers["norm.num_batches_tracked"].fill_(float("nan"))
    fz.save(state, tmp_path)
    with pytest.raises(CheckpointError, match=r"buffers/norm.num_batches_tracked is torch.float32 in it, torch.int64 "
                                              "here: damaged or altered"):
        fz.restore(_normed(), tmp_path)


def test_an_index_size_of_a_million_dimensions_is_refused_in_a_line(tmp_path):
    """index.json's sizes were unbounded: a tensor of 10**6 dimensions printed in full in the error."""
    fz.save(_trained(), tmp_path)
    step = tmp_path / "step_1"
    index = json.loads((step / "index.json").read_text())
    next(iter(index["tensors"].values()))["size"] = [1] * 10**6
    (step / "index.json").write_text(json.dumps(index))
    _relist(step, "index.json")
    with pytest.raises(CheckpointError, match=r"bad size \[1, 1, .* \(a list of at most 64 integers >= 0\)") as e:
        fz.restore(fz.init(make_model(1), spec(1, 1)), step)
    assert len(str(e.value)) < 1000
