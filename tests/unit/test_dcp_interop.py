"""torch DCP interop in one process: torchtitan's Llama names and RoPE order, an import of a real
`dcp.save` directory (no process group) that is the source checkpoint bit for bit, an export that
`dcp.load` reads back, and every refusal in one line with nothing committed.

The multi-process case (FSDP2 x TP save, `train --resume`, loads on 1, 2 and 4 ranks) is
tests/integration/test_dcp_interop_distributed.py."""
from __future__ import annotations

import io
import os
import pickle
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from rayshard.actors.checkpoint.stored import StoredCheckpoint
from rayshard.actors.model.transformer import Transformer
from rayshard.cluster.catalog.store import Store
from rayshard.cluster.checkpoint.dcp_records import read_plain_value
from rayshard.cluster.checkpoint.transform_exec import run_group
from rayshard.cluster.cli.main import main
from rayshard.plans.interop.torchtitan import torchtitan_mapping
from rayshard.plans.training.model_spec import parameter_shapes, preset
from rayshard.plans.transforms.codec import decode_rule, encode_rule
from rayshard.plans.transforms.mapping import Mapping, Meta, RegroupRows
from tests.integration.reshard_helpers import digests
from tests.torchtitan_llama import Transformer as TorchtitanLlama
from tests.torchtitan_llama import torchtitan_from_ours
from tests.unit.checkpoint_factory import write_checkpoint

CONFIG = preset("tiny")
KINDS = ("param", "exp_avg", "exp_avg_sq")


def _whole(url: str, kind: str) -> dict[str, torch.Tensor]:
    stored = StoredCheckpoint(url)
    return {name: stored.read_region(name, kind, (0,) * len(shape), tuple(shape))
            for name, shape in parameter_shapes(CONFIG).items()}


def _dcp_state(url: str, step: int, layout: str) -> dict:
    """The checkpoint's tensors as torchtitan names them, in the state dict a user hands dcp.save:
    torchtitan's (model at the top, the optimizer flattened under `optimizer.`) or the plain
    `{"model": ..., "optim": get_state_dict(...)[1]}`."""
    weights = torchtitan_from_ours(_whole(url, "param"), CONFIG)
    moments = {kind: torchtitan_from_ours(_whole(url, kind), CONFIG) for kind in KINDS[1:]}
    state = {name: {"step": torch.tensor(float(step)), "exp_avg": moments["exp_avg"][name],
                    "exp_avg_sq": moments["exp_avg_sq"][name]} for name in weights}
    if layout == "torchtitan":
        flat = {f"state.{name}.{key}": value for name, entry in state.items() for key, value in entry.items()}
        flat.update({f"param_groups.{name}.lr": 0.01 for name in weights})
        return {**weights, "optimizer": flat, "train_state": {"step": step}}
    return {"model": weights, "optim": {"state": state, "param_groups": [{"lr": 0.01, "params": list(weights)}]}}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A rayshard checkpoint (tiny, 2 AdamW steps) and the same state saved by dcp.save, both layouts."""
    root = tmp_path_factory.mktemp("dcp")
    store = str(root / "store")
    url, _, _ = write_checkpoint(store, "src", CONFIG)
    directories = {}
    for layout in ("torchtitan", "plain"):
        directories[layout] = str(root / f"dcp-{layout}")
        dcp.save(_dcp_state(url, 2, layout), checkpoint_id=directories[layout], no_dist=True)
    return store, url, directories


def test_regroup_rows_inverts_and_round_trips_as_data():
    rule = RegroupRows("w", 3, 2, 4)
    assert rule.inverse() == RegroupRows("w", 3, 4, 2) and rule.inverse().inverse() == rule
    assert decode_rule(encode_rule(rule)) == rule
    tensor = torch.arange(24 * 5).reshape(24, 5)
    plan = Mapping((rule,)).plan({"w": Meta((24, 5), "int64")})
    moved = run_group(plan.groups[0], {"w": tensor})["w"]
    assert torch.equal(moved[1], tensor[4]) and torch.equal(moved[2], tensor[1])  # per group: [2, 4] rows -> [4, 2]
    back = Mapping((rule,)).inverse().plan({"w": Meta((24, 5), "int64")})
    assert torch.equal(run_group(back.groups[0], {"w": moved})["w"], tensor)


def test_the_mapping_is_torchtitans_names_and_rope_order():
    """Our model and a model computing as torchtitan's does (adjacent-pair RoPE, separate
    wq/wk/wv, w1/w3) give the same logits once the mapping has moved the weights; and the mapping
    agrees with a conversion written by hand the way torchtitan's adapter permutes."""
    torch.manual_seed(0)
    ours = Transformer(CONFIG)
    with torch.no_grad():
        for parameter in ours.parameters():
            parameter.normal_(0, 0.2)
    state = {name: tensor.detach() for name, tensor in ours.state_dict().items()}
    plan = torchtitan_mapping(CONFIG).plan({name: Meta(tuple(t.shape), "float32") for name, t in state.items()})
    mapped = {}
    for group in plan.groups:
        mapped.update(run_group(group, {name: state[name] for name in group.sources}))
    by_hand = torchtitan_from_ours(state, CONFIG)
    assert mapped.keys() == by_hand.keys() and all(torch.equal(mapped[k], by_hand[k]) for k in mapped)
    theirs = TorchtitanLlama(CONFIG)
    theirs.load_state_dict(mapped)
    tokens = torch.randint(0, CONFIG.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (ours(tokens) - theirs(tokens)).abs().max().item() <= 1e-4
        # Without the row permutation the logits differ: the test sees the RoPE convention.
        unpermuted = dict(mapped)
        for name in mapped:
            if name.endswith(("wq.weight", "wk.weight")):
                heads = CONFIG.n_heads if name.endswith("wq.weight") else CONFIG.n_kv_heads
                rows = mapped[name].reshape(heads, CONFIG.head_dim // 2, 2, -1).transpose(1, 2)
                unpermuted[name] = rows.reshape(mapped[name].shape)
        theirs.load_state_dict(unpermuted)
        assert (ours(tokens) - theirs(tokens)).abs().max().item() > 1e-2


@pytest.mark.parametrize("layout", ["torchtitan", "plain"])
def test_a_dcp_save_imports_as_the_source_checkpoint(source, layout, tmp_path, capsys):
    store, url, directories = source
    target = str(tmp_path / "store")
    assert main(["ckpt", "import", directories[layout], "--format", "dcp", "--model", "tiny", "--run", "imported",
                 "--store", target, "--quiet"]) == 0
    imported = Store(target).resolve("imported").url
    assert digests(imported) == digests(url)  # weights and both moments, bit for bit
    assert Store(target).committed_steps("imported") == [2]  # AdamW's step
    assert "skipped" in capsys.readouterr().out


@pytest.mark.parametrize("views", [True, False])
def test_bands_from_memory_maps_and_from_reads_import_alike(source, views, tmp_path, monkeypatch):
    """Decision 131: bands taken from read-only maps of the .distcp pages (a renamed band is the
    map itself, qkv and gate_up gathered straight from it) and bands read into buffers give the
    same checkpoint, bit for bit; the maps are used (none is left mapped afterwards)."""
    from rayshard.cluster.checkpoint import dcp_import, row_bands

    taken = []  # whether each band came from maps (not the band itself: it would keep its map alive)

    def from_views(*args):
        band = original(*args)
        taken.append(band is not None)
        return band
    original = row_bands._from_views
    monkeypatch.setattr(row_bands, "_from_views", from_views)
    store, url, directories = source
    target = str(tmp_path / "store")
    dcp_import.import_dcp(directories["torchtitan"], Store(target), "mapped", CONFIG, "--model tiny", log=lambda *_: None,
                          views=views)
    assert digests(Store(target).resolve("mapped").url) == digests(url)
    assert (len(taken) > 0 and all(taken)) == views
    assert not [line for line in open("/proc/self/maps") if ".distcp" in line]


@pytest.mark.parametrize("read_ahead", [True, False])
def test_bands_read_ahead_on_a_thread_and_in_turn_import_alike(source, read_ahead, tmp_path, monkeypatch):
    """Decision 195: with the read-ahead, every band is produced on its background thread while the
    writer writes the one before (in two buffer sets); without it, on the writer's thread. Both give
    the source checkpoint bit for bit, and no read-ahead thread outlives the import."""
    import threading

    from rayshard.cluster.checkpoint import dcp_import

    threads = []

    def fill_band(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return original(*args, **kwargs)
    original = dcp_import.fill_band
    monkeypatch.setattr(dcp_import, "fill_band", fill_band)
    store, url, directories = source
    target = str(tmp_path / "store")
    dcp_import.import_dcp(directories["torchtitan"], Store(target), "ahead", CONFIG, "--model tiny", log=lambda *_: None,
                          band_bytes=2048, read_ahead=read_ahead)
    assert digests(Store(target).resolve("ahead").url) == digests(url)
    assert len(threads) > 10 and set(threads) == {"rayshard-read-ahead" if read_ahead else threading.main_thread().name}
    assert not [thread for thread in threading.enumerate() if thread.name == "rayshard-read-ahead"]


@pytest.mark.parametrize("given", ["--hf-config", "--config"])
def test_the_model_configuration_may_come_from_a_config_json_or_a_train_config(source, given, tmp_path):
    store, url, directories = source
    if given == "--hf-config":
        value = _hf_config(tmp_path, ffn=CONFIG.ffn_dim)
    else:
        (tmp_path / "train.yaml").write_text("model:\n  preset: tiny\n")
        value = str(tmp_path / "train.yaml")
    target = str(tmp_path / "store")
    assert main(["ckpt", "import", directories["plain"], "--format", "dcp", given, value, "--run", "imported",
                 "--store", target, "--quiet"]) == 0
    assert digests(Store(target).resolve("imported").url) == digests(url)


def test_the_export_loads_with_dcp_as_torchtitan_named_the_source(source, tmp_path):
    store, url, directories = source
    out = str(tmp_path / "export")
    assert main(["ckpt", "export", "src@2", "--store", store, "--format", "dcp", "--out", out, "--workers", "2",
                 "--quiet"]) == 0
    assert sorted(os.listdir(out)) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    expected = _dcp_state(url, 2, "torchtitan")
    metadata = FileSystemReader(out).read_metadata()
    loaded = {key: torch.empty(entry.size, dtype=entry.properties.dtype)
              for key, entry in metadata.state_dict_metadata.items() if hasattr(entry, "size")}
    dcp.load(loaded, checkpoint_id=out, no_dist=True)
    flat = {**{k: v for k, v in expected.items() if k not in ("optimizer", "train_state")},
            **{f"optimizer.{k}": v for k, v in expected["optimizer"].items() if not k.startswith("param_groups")}}
    # torchtitan's TrainState step too, as it saves it: a 0-d int32 tensor its loader reads with .item().
    flat["train_state.step"] = torch.tensor(2, dtype=torch.int32)
    assert loaded.keys() == flat.keys()
    for key, tensor in flat.items():
        assert torch.equal(loaded[key], tensor) and loaded[key].dtype == tensor.dtype, key
    train_state = {"train_state": {"step": torch.tensor(0, dtype=torch.int32)}}  # TrainState.state_dict()'s shape
    dcp.load(train_state, checkpoint_id=out, no_dist=True)
    assert train_state["train_state"]["step"].item() == 2
    # And it imports back to the same checkpoint.
    target = str(tmp_path / "back")
    assert main(["ckpt", "import", out, "--format", "dcp", "--model", "tiny", "--run", "back", "--store", target,
                 "--quiet"]) == 0
    assert digests(Store(target).resolve("back").url) == digests(url)


def test_an_export_killed_midway_leaves_no_directory(source, tmp_path):
    """The export writes DIR.partial-* and renames it into place last: a kill -9 leaves no DIR."""
    store, url, _ = source
    out = tmp_path / "killed"
    script = ("import sys; from rayshard.cluster.checkpoint.dcp_export import export_dcp; "
              f"export_dcp({url!r}, {str(out)!r}, band_bytes=256, log=lambda *_: None)")
    child = subprocess.Popen([sys.executable, "-c", script], env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        deadline = time.monotonic() + 120
        while not any(p.name.startswith("killed.partial-") and any(p.iterdir()) for p in tmp_path.iterdir()):
            assert child.poll() is None and time.monotonic() < deadline, "the export ended before it could be killed"
            time.sleep(0.05)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait(timeout=30)
    assert not out.exists()


@pytest.mark.parametrize("adamw", [False, True])
def test_torchtitans_train_state_step_as_a_0d_tensor_is_the_step(source, adamw, tmp_path, capsys):
    """torchtitan's TrainState saves `torch.tensor(step, dtype=torch.int32)`: the step of a
    model-only checkpoint; where AdamW's own step is there too and differs, AdamW's (noted)."""
    store, url, _ = source
    state = _dcp_state(url, 2, "torchtitan")
    if not adamw:
        state = {key: value for key, value in state.items() if key != "optimizer"}
    state["train_state"] = {"step": torch.tensor(7, dtype=torch.int32)}
    directory = str(tmp_path / "dcp")
    dcp.save(state, checkpoint_id=directory, no_dist=True)
    target = str(tmp_path / "store")
    assert main(["ckpt", "import", directory, "--format", "dcp", "--model", "tiny", "--run", "titan", "--store", target]) == 0
    assert Store(target).committed_steps("titan") == [2 if adamw else 7]
    out = capsys.readouterr().out
    assert ("train_state.step 7 but AdamW's step 2" in out) == adamw
    state["train_state"] = {"step": torch.tensor([1, 2], dtype=torch.int32)}  # not a number: refused, nothing committed
    other = str(tmp_path / "dcp-2")
    dcp.save(state, checkpoint_id=other, no_dist=True)
    error = _refused(capsys, _import(other, target), target)
    assert "train_state.step is int32[2]" in error


def _refused(capsys, argv, store) -> str:
    assert main(argv) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "Traceback" not in error, error
    assert not os.path.exists(os.path.join(store, "bad"))  # nothing committed: the store is untouched
    return error


def _copy(directory: str, tmp_path) -> str:
    import shutil

    copy = str(tmp_path / "copy")
    shutil.copytree(directory, copy)
    return copy


def _import(directory, store):
    return ["ckpt", "import", directory, "--format", "dcp", "--model", "tiny", "--run", "bad", "--store", store]


class _Shell:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_metadata_pickling_another_class_is_refused_unrun(source, tmp_path, capsys):
    copy = _copy(source[2]["torchtitan"], tmp_path)
    marker = tmp_path / "ran"
    with open(os.path.join(copy, ".metadata"), "wb") as handle:
        pickle.dump(_Shell(marker), handle)
    store = str(tmp_path / "store")
    error = _refused(capsys, _import(copy, store), store)
    assert "system" in error and "not one of DCP's metadata classes" in error
    assert not marker.exists()


def test_a_truncated_metadata_is_refused(source, tmp_path, capsys):
    copy = _copy(source[2]["torchtitan"], tmp_path)
    path = os.path.join(copy, ".metadata")
    data = open(path, "rb").read()
    open(path, "wb").write(data[:len(data) // 2])
    store = str(tmp_path / "store")
    assert "truncated or damaged" in _refused(capsys, _import(copy, store), store)


def test_an_unknown_dcp_version_is_refused(source, tmp_path, capsys):
    copy = _copy(source[2]["torchtitan"], tmp_path)
    path = os.path.join(copy, ".metadata")
    metadata = FileSystemReader(copy).read_metadata()
    metadata.version = "9.0.0"
    with open(path, "wb") as handle:
        pickle.dump(metadata, handle)
    store = str(tmp_path / "store")
    assert "version '9.0.0'" in _refused(capsys, _import(copy, store), store)


def test_storage_transforms_and_a_truncated_distcp_are_refused(source, tmp_path, capsys):
    copy = _copy(source[2]["torchtitan"], tmp_path)
    path = os.path.join(copy, ".metadata")
    metadata = FileSystemReader(copy).read_metadata()
    next(iter(metadata.storage_data.values())).transform_descriptors = ["zstd"]
    with open(path, "wb") as handle:
        pickle.dump(metadata, handle)
    store = str(tmp_path / "store")
    assert "['zstd']" in _refused(capsys, _import(copy, store), store)
    import shutil

    shutil.rmtree(copy)
    copy = _copy(source[2]["torchtitan"], tmp_path)
    distcp = os.path.join(copy, "__0_0.distcp")
    os.truncate(distcp, os.path.getsize(distcp) - 100)
    assert "truncated" in _refused(capsys, _import(copy, store), store)


def test_a_shape_that_does_not_fit_the_model_is_named(source, tmp_path, capsys):
    store = str(tmp_path / "store")
    error = _refused(capsys, ["ckpt", "import", source[2]["torchtitan"], "--format", "dcp", "--hf-config",
                              _hf_config(tmp_path, ffn=192), "--run", "bad", "--store", store], store)
    assert "feed_forward.w" in error and "[160, 64]" in error and "[192, 64]" in error
    error = _refused(capsys, ["ckpt", "import", source[2]["torchtitan"], "--format", "dcp", "--run", "bad", "--store",
                              store], store)
    assert "exactly one of --hf-config" in error


def _hf_config(tmp_path, ffn: int) -> str:
    import json

    from rayshard.plans.interop.hf_families import hf_config

    directory = tmp_path / "hf"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({**hf_config(CONFIG, "float32"), "intermediate_size": ffn}))
    return str(directory)


def test_non_tensor_items_are_read_only_as_plain_values(tmp_path):
    marker = tmp_path / "ran"
    buffer = io.BytesIO()
    torch.save(_Shell(marker), buffer)
    skipped = read_plain_value(buffer.getvalue())
    assert skipped.value is None and "system" in skipped.skipped and not marker.exists()
    buffer = io.BytesIO()
    torch.save({"step": 7, "lr": 0.5, "name": "x"}, buffer)
    assert read_plain_value(buffer.getvalue()).value == {"step": 7, "lr": 0.5, "name": "x"}


@pytest.mark.parametrize("crafted", ["objects", "colliding-keys"])
def test_a_metadata_crafted_to_exhaust_memory_or_time_is_refused_before_it_is_built(source, tmp_path, capsys, crafted):
    """Only admitted classes are no bound on what a pickle builds: a list of a million empty
    dicts (about a byte each in the file, 64 bytes each in memory) or dict keys that all hash
    alike (quadratic to insert) is refused by the scan before anything is unpickled."""
    copy = _copy(source[2]["torchtitan"], tmp_path)
    if crafted == "objects":
        body = pickle.PROTO + bytes([4]) + pickle.EMPTY_LIST + pickle.MARK + pickle.EMPTY_DICT * 1_000_000 + pickle.APPENDS
    else:
        keys = b"".join(pickle.dumps(k * (2**61 - 1), protocol=4)[2:-1] + pickle.NONE for k in range(1, 200))
        body = pickle.PROTO + bytes([4]) + pickle.EMPTY_DICT + pickle.MARK + keys + pickle.SETITEMS
    with open(os.path.join(copy, ".metadata"), "wb") as handle:
        handle.write(body + pickle.STOP)
    store = str(tmp_path / "store")
    error = _refused(capsys, _import(copy, store), store)
    assert ("builds more than" in error) if crafted == "objects" else ("larger than any offset" in error), error


def test_a_tensor_record_that_is_compressed_or_lists_many_entries_is_refused(tmp_path):
    """torch.save never compresses and writes a handful of entries: anything else could inflate
    or list without bound, so it is refused before any entry is read."""
    import io
    import zipfile

    from rayshard.cluster.checkpoint.dcp_metadata import DcpChunk
    from rayshard.cluster.checkpoint.dcp_records import locate_chunk, read_plain_value
    from rayshard.plans.errors import CheckpointError

    for name, make in [("compressed", lambda z: z.writestr(zipfile.ZipInfo("a/data.pkl"), b"x" * 1000,
                                                           compress_type=zipfile.ZIP_DEFLATED)),
                       ("many", lambda z: [z.writestr(f"a/{i}", b"") for i in range(200)])]:
        buffer = io.BytesIO()
        with zipfile.ZipFile(buffer, "w") as archive:
            make(archive)
        data = buffer.getvalue()
        assert read_plain_value(data).skipped.startswith("unreadable"), name
        with pytest.raises(CheckpointError, match="is not a torch.save record"):
            locate_chunk(io.BytesIO(data), DcpChunk((0,), (4,), "f", 0, len(data)), "float32", name)


@pytest.mark.parametrize("where, value", [("train_state", float("nan")), ("adamw", float("inf"))])
def test_a_step_that_is_not_a_finite_number_is_refused_in_one_line(source, tmp_path, capsys, where, value):
    store, url, _ = source
    state = _dcp_state(url, 2, "torchtitan")
    if where == "train_state":
        state = {key: item for key, item in state.items() if key != "optimizer"}
        state["train_state"] = {"step": torch.tensor(value)}
    else:
        for key in state["optimizer"]:
            if key.endswith(".step"):
                state["optimizer"][key] = torch.tensor(value)
    directory = str(tmp_path / "dcp")
    dcp.save(state, checkpoint_id=directory, no_dist=True)
    target = str(tmp_path / "store")
    assert "not a whole number" in _refused(capsys, _import(directory, target), target)


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_a_metadata_that_is_no_regular_file_is_refused_unread(source, tmp_path, capsys, kind):
    """A FIFO or a link to /dev/zero reports size 0 and never ends: refused before any read."""
    copy = _copy(source[2]["torchtitan"], tmp_path)
    path = os.path.join(copy, ".metadata")
    os.remove(path)
    os.mkfifo(path) if kind == "fifo" else os.symlink("/dev/zero", path)
    store = str(tmp_path / "store")
    assert "is not a regular file" in _refused(capsys, _import(copy, store), store)


def test_an_import_into_a_step_already_committed_is_refused_before_writing(source, tmp_path, capsys):
    directory = source[2]["torchtitan"]
    target = str(tmp_path / "store")
    argv = ["ckpt", "import", directory, "--format", "dcp", "--model", "tiny", "--run", "again", "--store", target]
    assert main(argv) == 0
    step_dir = os.path.join(target, "again", "checkpoints", os.listdir(os.path.join(target, "again", "checkpoints"))[0])
    before = sorted(os.listdir(step_dir))
    capsys.readouterr()
    assert main(argv) == 2
    error = capsys.readouterr().err.strip()
    assert "is already committed" in error and len(error.splitlines()) == 1
    assert sorted(os.listdir(step_dir)) == before  # no second attempt's files
