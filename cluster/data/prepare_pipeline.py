"""`data prepare`'s tokenizing on Ray Data: a dataset of units (consecutive input files), one
`map_batches` call per unit writing that unit's token shard, results streamed back in unit order.

Ray Data schedules, retries and bounds the tasks; the driver consumes results as they finish (the
progress bar advances by each unit's input bytes) and stops at the first bad input. Each result is
one row of plain columns (lists of per-document values), never a pickled object.
"""
from __future__ import annotations

import json
import logging
import queue
import threading
from collections.abc import Iterator

import numpy as np
import ray
import ray.data

from rayshard.cluster.data.documents import ReadOptions
from rayshard.cluster.data.examples import ChatTemplate
from rayshard.cluster.data.prepare_task import UnitResult, tokenize_unit
from rayshard.plans.data.errors import DataInputError
from rayshard.plans.errors import RayshardError

_LIST_COLUMNS = ("sources", "rows", "tokens", "crc32", "skipped", "loss_tokens", "mask_crc32")


def tokenize_units(batch: dict[str, np.ndarray], *, tokenizer_json: str, eos_id: int, dtype: str, dataset_url: str,
                   attempt: str, options: ReadOptions, storage_conf: dict, chat: ChatTemplate | None = None) -> dict[str, list]:
    """map_batches' function: each row is a unit (its number and files); returns one row per unit."""
    columns: dict[str, list] = {name: [] for name in ("unit", "shard", "mask", "longest", "input_bytes", "error", *_LIST_COLUMNS)}
    for unit, files in zip(batch["unit"], batch["files"]):
        unit = int(unit)
        result = tokenize_unit(unit, [str(f) for f in files], tokenizer_json, eos_id, dtype, dataset_url,
                               f"{attempt}/shard-{unit:05d}.tokens", options, storage_conf, chat)
        columns["unit"].append(unit)
        columns["shard"].append(result.shard)
        columns["mask"].append(result.mask)
        columns["longest"].append(result.longest)
        columns["input_bytes"].append(result.input_bytes)
        # A DataInputError crosses as its four fields, and becomes the same error on the driver.
        error = result.error
        columns["error"].append("" if error is None else json.dumps([error.source, error.row, error.problem, error.fix]))
        for name in _LIST_COLUMNS:
            columns[name].append(list(getattr(result, name)))
    return columns


def _unit_result(row: dict) -> UnitResult:
    error = DataInputError(*json.loads(row["error"])) if row["error"] else None
    return UnitResult(int(row["unit"]), row["shard"], sources=[str(s) for s in row["sources"]],
                      rows=[int(r) for r in row["rows"]], tokens=[int(t) for t in row["tokens"]],
                      crc32=[int(c) for c in row["crc32"]], input_bytes=int(row["input_bytes"]),
                      skipped=[str(s) for s in row["skipped"]], error=error, mask=str(row["mask"]),
                      loss_tokens=[int(t) for t in row["loss_tokens"]], mask_crc32=[int(c) for c in row["mask_crc32"]],
                      longest=int(row["longest"]))


def run_units(units: list[list[str]], tokenizer_json: str, eos_id: int, dtype: str, dataset_url: str, attempt: str,
              options: ReadOptions, storage_conf: dict, cpus_per_task: float, concurrency: int,
              task_timeout_s: float, chat: ChatTemplate | None = None) -> Iterator[UnitResult]:
    """Each unit's result as it finishes (in no fixed order). Raises when no unit finishes within
    task_timeout_s; closing the iterator (the caller stops at bad input) stops the dataset."""
    logging.getLogger("ray.data").setLevel(logging.ERROR)  # its notes on progress bars and plans, not ours
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False  # the CLI draws one bar of input bytes (cluster/progress.py)
    context.print_on_execution_start = False
    # Ray Data reserves half the cluster's CPUs per operator by default, so a single map operator
    # got half the CPUs: on 2 CPUs the units ran one at a time (bench/data.py, decision 77). The
    # pipeline has one operator after its in-memory input, so there is nothing to reserve against.
    context.op_resource_reservation_enabled = False
    items = [{"unit": number, "files": files} for number, files in enumerate(units)]
    dataset = ray.data.from_items(items, override_num_blocks=len(units)).map_batches(
        tokenize_units, batch_size=1, batch_format="numpy", num_cpus=cpus_per_task,
        compute=ray.data.TaskPoolStrategy(size=concurrency), fn_kwargs=dict(tokenizer_json=tokenizer_json, eos_id=eos_id, dtype=dtype, dataset_url=dataset_url,
                                      attempt=attempt, options=options, storage_conf=storage_conf, chat=chat))
    # Ray Data has no per-task deadline: a thread consumes the stream and the driver waits on it
    # with one, so a stuck store or a cluster with no free CPU fails in one line instead of hanging.
    results: queue.Queue = queue.Queue()  # one small row per unit; Ray Data bounds the work in flight
    stop = threading.Event()
    done = object()

    def consume() -> None:
        rows = iter(dataset.iter_rows())
        try:
            for row in rows:
                results.put(_unit_result(row))
                if stop.is_set():
                    break
        except BaseException as error:  # noqa: BLE001 - handed to the driver's thread and raised there
            results.put(error)
        finally:
            # Closing the stream shuts Ray Data's executor down with force: the units still running
            # are cancelled and waited for, so none writes into an attempt the driver then removes.
            getattr(rows, "close", lambda: None)()
            results.put(done)

    consumer = threading.Thread(target=consume, name="rayshard-prepare", daemon=True)
    consumer.start()
    try:
        for _ in range(len(units)):
            try:
                item = results.get(timeout=task_timeout_s)
            except queue.Empty:
                raise RayshardError(f"no tokenization task finished within {task_timeout_s:g} s. Fix: check the "
                                    "cluster's free CPUs (--cpus-per-task) and the input store, or raise --task-timeout") from None
            if item is done:
                raise RayshardError("Ray Data ended the tokenization with units missing. Fix: run it again")
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        consumer.join(timeout=task_timeout_s)
