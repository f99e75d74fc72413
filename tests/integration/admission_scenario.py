"""Runs `rayshard train` several times in one process against its own 2-CPU Ray (issue 19).

The test session's shared Ray has 8 logical CPUs; this scenario needs the arithmetic of a real
2-CPU machine, so the test runs it in a subprocess with its own `ray.init(num_cpus=2)`. Prints one
JSON line: per CLI call, its exit code, stderr and seconds.
"""
import io
import json
import os
import sys
import time
from contextlib import redirect_stderr

import ray

from rayshard.storage.manifest_io import read_manifest
from rayshard.cluster.cli.main import main
from rayshard.cluster.catalog.store import Store


def cli(argv: list[str], debug: bool = False) -> dict:
    os.environ["RAYSHARD_DEBUG"] = "1" if debug else ""
    stderr, started = io.StringIO(), time.monotonic()
    with redirect_stderr(stderr):
        code = main(argv)
    return {"argv": argv, "code": code, "stderr": stderr.getvalue(), "seconds": time.monotonic() - started}


def corrupt_one_chunk(store: str, run: str) -> str:
    """Flip a byte inside the first parameter chunk of the run's latest checkpoint; its file name."""
    url = Store(store).resolve("latest", current_run=run).url
    chunks, _ = read_manifest(url)
    chunk = next(c for c in chunks if c.kind == "param" and c.byte_end - c.byte_start > 64)
    with open(f"{url}/{chunk.file}", "r+b") as handle:
        middle = (chunk.byte_start + chunk.byte_end) // 2
        handle.seek(middle)
        byte = handle.read(1)
        handle.seek(middle)
        handle.write(bytes([byte[0] ^ 0x40]))
    return chunk.file


def main_scenario(workdir: str) -> None:
    ray.init(address="local", num_cpus=2, num_gpus=0, include_dashboard=False, logging_level="WARNING",
             log_to_driver=False)
    config = os.path.join(workdir, "tiny.yaml")
    with open(config, "w") as handle:
        handle.write("model: {preset: tiny}\nglobal_batch: 6\nseq_len: 32\n"
                     "optimizer: {warmup_steps: 1}\ndata: {source: stdlib, max_bytes: 300000}\n")
    store = os.path.join(workdir, "store")
    common = ["train", "--config", config, "--store", store, "--dp", "3", "--tp", "1", "--pp", "1"]
    results = {"three_ranks": cli(common + ["--run", "a", "--steps", "1"])}
    results["too_many_cpus"] = cli(common + ["--run", "b", "--steps", "1", "--cpus-per-rank", "1", "--start-timeout", "3"])
    results["other_model"] = cli(common + ["--run", "a", "--steps", "2", "--resume", "latest", "--model", "small"])
    elastic = ["train", "--config", config, "--store", store, "--elastic", "--dp", "2", "--tp", "2", "--steps", "1"]
    results["elastic_default_share"] = cli(elastic + ["--run", "e"])
    results["elastic_one_cpu_per_rank"] = cli(elastic + ["--run", "f", "--cpus-per-rank", "1"])
    results["corrupted_file"] = corrupt_one_chunk(store, "a")
    resume = common + ["--run", "a", "--steps", "2", "--resume", "latest"]
    results["damaged"] = cli(resume)
    results["damaged_debug"] = cli(resume, debug=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main_scenario(sys.argv[1])
