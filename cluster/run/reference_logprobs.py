"""`rayshard data reference-logprobs`: a preference dataset's reference log-probabilities,
computed once on Ray by one rank actor that loads the reference checkpoint (any layout wrote it),
written beside the dataset's index keyed by its index hash and the reference's digest, one file
per reference (plans/data/reference_logprobs.py; decisions 162, 201). A `--dpo-precomputed` run
then runs no reference at all: the driver picks its reference's file, and refuses a dataset that
has none, naming the references it has."""
from __future__ import annotations

from collections.abc import Callable

import fsspec

from rayshard.actors.checkpoint.stored import StoredCheckpoint
from rayshard.cluster.catalog.store import Store
from rayshard.cluster.ray_connection import connect_ray
from rayshard.cluster.run.dpo_reference import DpoReference
from rayshard.cluster.run.lora_base import base_digest
from rayshard.cluster.run.rank_group import RankGroup
from rayshard.plans.checkpoint.model_check import check_against_own_model
from rayshard.plans.config import DataConfig, DpoConfig, ModelChoice, TrainConfig
from rayshard.plans.data.dataset_index import INDEX, PREFERENCE, decode_index
from rayshard.plans.data.reference_logprobs import (LEGACY_REFERENCE_LOGPROBS, REFERENCE_LOGPROBS_DIR, decode_reference_logprobs,
                                                    encode_reference_logprobs, reference_logprobs_file)
from rayshard.plans.errors import ConfigError


def compute_reference_logprobs(dataset_url: str, reference: str, store_url: str, actors: list | None = None,
                               log: Callable[[str], None] = print) -> str:
    """Write dataset_url/reference-logprobs/<digest>.parquet from checkpoint `reference` (RUN@STEP or a URL)."""
    dataset_url = dataset_url.rstrip("/")
    store = Store(store_url)
    url = store.resolve(reference).url
    stored = StoredCheckpoint(url)
    if "lora" in stored.metadata:
        raise ConfigError("from", reference, "is a LoRA run's checkpoint (adapters only); a LoRA DPO run's reference is "
                          "its base", "pass the base checkpoint (the run's --lora-base)")
    spec = check_against_own_model(stored.chunks, stored.metadata, url)
    fs, root = fsspec.core.url_to_fs(dataset_url)
    meta, _ = decode_index(fs.cat_file(f"{root}/{INDEX}"), f"{dataset_url}/{INDEX}")
    if meta.kind != PREFERENCE:
        raise ConfigError("data", dataset_url, f"holds {meta.kind} data, not preference pairs",
                          "pass the --out of `rayshard data prepare --format preference`")
    config = TrainConfig(model=ModelChoice(preset=stored.metadata.get("model_preset") or "imported", spec=spec),
                         data=DataConfig(dataset=dataset_url), seq_len=max(1, meta.longest - 1), global_batch=2,
                         steps=1, objective="dpo", dpo=DpoConfig(precomputed=True), store=store_url,
                         run="reference-logprobs").validate()
    connect_ray(config.resources.start_timeout_s)
    group = RankGroup(config, actors)
    try:
        group.call("configure_storage", store.storage_conf, timeout=config.resources.start_timeout_s)
        group.call("load", url)
        logps = group.call("reference_logprobs", dataset_url)[0]
    finally:
        group.shutdown()
    digest = base_digest(url)
    name = write_reference_logprobs(dataset_url, logps, meta.index_hash, {"url": url, "digest": digest})
    log(f"wrote {dataset_url}/{name}: {len(logps)} examples' log-probabilities under {url} "
        f"(digest {digest[:19]}...)")
    return f"{dataset_url}/{name}"


def write_reference_logprobs(dataset_url: str, logps, index_hash: str, reference: dict) -> str:
    """The reference's file beside the others, as one put of the whole file: a reader sees the
    previous file or this one, and other references' files are left alone (decision 201).
    Returns its path relative to the dataset."""
    fs, root = fsspec.core.url_to_fs(dataset_url.rstrip("/"))
    name = reference_logprobs_file(reference["digest"])
    fs.makedirs(f"{root}/{REFERENCE_LOGPROBS_DIR}", exist_ok=True)
    fs.pipe_file(f"{root}/{name}", encode_reference_logprobs(logps, index_hash, reference))
    return name


def check_precomputed(dataset_url: str, reference: DpoReference) -> str:
    """A --dpo-precomputed run's file: the one of this dataset computed with this run's reference
    (its digest-named file, or a dataset's old single file holding that reference); returns its
    path relative to the dataset, which the ranks then read. One line, naming the references the
    dataset has, when none is this run's (decision 201)."""
    dataset_url = dataset_url.rstrip("/")
    fs, root = fsspec.core.url_to_fs(dataset_url)
    source = reference.url or "a checkpoint of the reference"
    available = []
    for name in _held_files(fs, root, reference.digest):
        _, meta = decode_reference_logprobs(fs.cat_file(f"{root}/{name}"), f"{dataset_url}/{name}")
        recorded = meta.get("reference") or {}
        if recorded.get("digest") == reference.digest:
            return name
        available.append(f"{recorded.get('url')} (digest {str(recorded.get('digest'))[:19]}...)")
    fix = f"run `rayshard data reference-logprobs --data {dataset_url} --from {source}`"
    if not available:
        raise ConfigError("dpo.precomputed", True, f"{dataset_url} holds no reference log-probabilities",
                          f"{fix}, or drop --dpo-precomputed")
    raise ConfigError("dpo.precomputed", True, f"{dataset_url} holds reference log-probabilities of {'; '.join(available)}, "
                      f"but this run's reference is {reference.describe()} (digest {reference.digest[:19]}...)",
                      f"{fix}, or train against one of those")


def _held_files(fs, root: str, digest: str) -> list[str]:
    """The dataset's reference log-probabilities files, the one named by `digest` first."""
    own = reference_logprobs_file(digest)
    try:
        named = sorted(f"{REFERENCE_LOGPROBS_DIR}/{path.rsplit('/', 1)[-1]}"
                       for path in fs.ls(f"{root}/{REFERENCE_LOGPROBS_DIR}", detail=False) if path.endswith(".parquet"))
    except FileNotFoundError:
        named = []
    legacy = [LEGACY_REFERENCE_LOGPROBS] if fs.exists(f"{root}/{LEGACY_REFERENCE_LOGPROBS}") else []
    return [name for name in named if name == own] + [name for name in named if name != own] + legacy
