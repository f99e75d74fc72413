"""`rayshard data reference-logprobs`: a preference dataset's reference log-probabilities,
computed once on Ray by one rank actor that loads the reference checkpoint (any layout wrote it),
written beside the dataset's index keyed by its index hash and the reference's digest
(plans/data/reference_logprobs.py; decision 162). A `--dpo-precomputed` run then runs no
reference at all, and refuses a file whose keys are not its own."""
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
from rayshard.plans.data.reference_logprobs import REFERENCE_LOGPROBS, decode_reference_logprobs, encode_reference_logprobs
from rayshard.plans.errors import ConfigError


def compute_reference_logprobs(dataset_url: str, reference: str, store_url: str, actors: list | None = None,
                               log: Callable[[str], None] = print) -> str:
    """Write dataset_url/reference-logprobs.parquet from checkpoint `reference` (RUN@STEP or a URL)."""
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
    fs.pipe_file(f"{root}/{REFERENCE_LOGPROBS}",
                 encode_reference_logprobs(logps, meta.index_hash, {"url": url, "digest": digest}))
    log(f"wrote {dataset_url}/{REFERENCE_LOGPROBS}: {len(logps)} examples' log-probabilities under {url} "
        f"(digest {digest[:19]}...)")
    return f"{dataset_url}/{REFERENCE_LOGPROBS}"


def check_precomputed(dataset_url: str, reference: DpoReference) -> None:
    """A --dpo-precomputed run's file must be this dataset's and this run's reference's (one line otherwise)."""
    fs, root = fsspec.core.url_to_fs(dataset_url.rstrip("/"))
    where = f"{dataset_url.rstrip('/')}/{REFERENCE_LOGPROBS}"
    source = reference.url or "a checkpoint of the reference"
    if not fs.exists(f"{root}/{REFERENCE_LOGPROBS}"):
        raise ConfigError("dpo.precomputed", True, f"{dataset_url} holds no reference log-probabilities",
                          f"run `rayshard data reference-logprobs --data {dataset_url} --from {source}`, or drop --dpo-precomputed")
    _, meta = decode_reference_logprobs(fs.cat_file(f"{root}/{REFERENCE_LOGPROBS}"), where)
    recorded = meta.get("reference") or {}
    if recorded.get("digest") != reference.digest:
        raise ConfigError("dpo.precomputed", True, f"{where} was computed with reference {recorded.get('url')} (digest "
                          f"{str(recorded.get('digest'))[:19]}...), but this run's reference is {reference.describe()} "
                          f"(digest {reference.digest[:19]}...)",
                          f"run `rayshard data reference-logprobs --data {dataset_url} --from {source}` again")
