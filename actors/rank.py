"""RankActor: the Ray actor that owns one rank (one GPU, or a CPU share with gloo).

A thin shell around `rayshard.actors.training.trainer.Trainer`: Ray only places the process and carries one RPC
per step; activations and gradients move between ranks over torch.distributed.
"""
from __future__ import annotations

import contextlib
import functools
import gc
import importlib
import os
import socket
import threading
import time
import traceback

import pyarrow
import ray
import torch

import rayshard.actors.snapshot.filesystem  # noqa: F401  (serves rayshard-snapshot:// in this rank, installed or not)
from rayshard.actors.training.reports import RankSetup, StepMetrics
from rayshard.actors.training.trainer import Trainer, WrapRunner
from rayshard.actors.parallel.failed_groups import keep_until_timed_out, release_timed_out
from rayshard.actors.parallel.group_sockets import cut_group_sockets
from rayshard.actors.waiting_where import where_thread_is
from rayshard.plans.checkpoint.chunk_table import ChunkTable
from rayshard.plans.config import TrainConfig
from rayshard.storage.options import apply_conf

# "module:function" naming a WrapRunner (`actors/training/trainer.py`) that each rank applies to
# its step runner. Read from the actor's environment (Ray's runtime_env env_vars, or the
# environment of the process that starts Ray), so a caller can change what a step does without
# the product knowing what: tests install faults this way (`tests/rank_faults.py`).
WRAP_RUNNER_ENV = "RAYSHARD_WRAP_RUNNER"


def wrap_runner_from_environment() -> WrapRunner | None:
    spec = os.environ.get(WRAP_RUNNER_ENV, "")
    if not spec:
        return None
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(f"{WRAP_RUNNER_ENV}={spec!r} must name a function as module:function, "
                         "e.g. tests.faults:install_from_environment; unset it to run steps as they are")
    return getattr(importlib.import_module(module), name)


def leaves_its_group_on_failure(method):
    """A rank that fails a call its peers take part in (a step, a load, a save) leaves the
    process group before it reports: its peers, blocked on it in a transfer or a collective, then
    fail at once (gloo: "Connection closed by peer") instead of waiting out the pipeline or
    collective timeout, and each of them leaves too. The error carries when it was raised, so
    the driver names the rank that failed first before the ones that only lost their peer.

    Destroying the group is not enough: a gloo group's sockets close only when nothing refers to
    it any more. So its sockets are shut down first (`cut_group_sockets`, decision 232): the peers
    see this rank leave at once. The groups themselves are kept until their timeout has passed
    (`keep_until_timed_out`, decision 233): freed now, one whose worker still waits in an
    operation would stop this process in its destructor. Then the traceback is kept as text (the
    driver shows it with RAYSHARD_DEBUG=1), the frames are dropped with the trainer, and the
    shutdown's collection frees the rest of the run now."""
    @functools.wraps(method)
    def guarded(self, *args, **kwargs):
        self.running = (method.__name__, threading.get_ident(), time.monotonic())  # for where_it_waits
        try:
            return method(self, *args, **kwargs)
        except Exception as error:
            with contextlib.suppress(AttributeError, TypeError):
                if getattr(error, "rayshard_raised_unix", None) is None:
                    error.rayshard_raised_unix = time.time()
                error.rayshard_rank_traceback = traceback.format_exc()
            failed = error
        finally:
            self.running = None
        # gloo only: NCCL's destroy can block on outstanding work, and its watchdog already
        # aborts a collective whose peer is gone.
        if self.trainer is not None and self.trainer.device.type == "cpu":
            # First: the peers see this rank leave now, every group's connections included (one a
            # pending gloo operation keeps open outlives the group's destruction, decision 232).
            cut_group_sockets()
            # Then keep the groups: freed now, one whose worker still waits in an operation would
            # stop this whole process in its destructor; they go at a set-up after their timeout.
            keep_until_timed_out(self.trainer.groups_held(), self.trainer.config.resources.collective_timeout_s)
            _drop_frames(failed)
            with contextlib.suppress(Exception):  # the group is lost either way; the error is what matters
                self.shutdown()  # (which collects: the frames' objects go now)
        raise failed
    return guarded


def _drop_frames(error: BaseException) -> None:
    """Forget the tracebacks of an error and of every error it chains (they hold the model)."""
    seen, pending = set(), [error]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        current.__traceback__ = None
        pending += [current.__cause__, current.__context__]


def _import_what_a_load_needs() -> None:
    """pyarrow imports pandas the first time it builds an array: 0.25 s on a quiet 2-core machine,
    1 s on a loaded one. A warm spare (cluster/run/rank_pool.py) that takes over a rank decodes the
    resumed checkpoint's manifest at once, and paid that on the recovery's path (bench/recovery.py:
    its load's manifest phase took 0.8-1.0 s against 0.02 s on a reused rank, decision 212). Every
    rank reads a manifest or a Parquet dataset sooner or later, so importing it at start costs none
    of them anything."""
    pyarrow.array([0])


# Saves kept answerable by checkpoint URL: the two that may be in flight, and a little history.
SAVES_REMEMBERED = 4


@ray.remote(concurrency_groups={"save_waits": 1, "inspect": 1})
class RankActor:
    def __init__(self):
        torch.set_num_threads(1)
        _import_what_a_load_needs()
        # What the imports made lives as long as the process: out of every later collection, so
        # the one each shutdown runs (to free a run's groups, decision 233) scans only what runs
        # made: 0.26 s a collection on this 2-core machine before, about 0 after.
        gc.freeze()
        self.trainer = None
        self.running: tuple[str, int, float] | None = None  # the peer-facing call running: name, thread, since
        # checkpoint URL -> its background save on this rank; `save_finished` (another thread) reads it
        self.background_saves: dict[str, object] = {}  # None: that save failed to start here
        self._saves_changed = threading.Condition()
        # Bumped when the rank is set up again or shut down: a `save_finished` still waiting from an
        # earlier attempt answers at once, so it never holds the save-waits thread from the next one.
        self._save_generation = 0
        # A warm spare that took a GPU rank's place: the dead rank's CUDA_VISIBLE_DEVICES, which Ray
        # did not assign to this actor (it started with no GPU) and which it then uses (decision 225).
        self.adopted_devices: str | None = None

    def rendezvous_address(self) -> str:
        """A TCP address on this actor's node that rank 0 will listen on."""
        host = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind(("", 0))
            port = probe.getsockname()[1]
        return f"tcp://{host}:{port}"

    def setup(self, config: TrainConfig, rank: int, init_method: str, plan=None, initialize: bool = True) -> RankSetup:
        """plan: the run's PipelinePlan (pp > 1), shipped once and replayed every step.
        initialize: draw the initial weights; False when a load fills every parameter next."""
        self.shutdown()  # a reused actor leaves its previous group first (and ends its save waits)
        release_timed_out()  # a failed run's groups, once nothing can be waiting in them (decision 233)
        # The GPU Ray assigned to this actor, if any (Ray narrows CUDA_VISIBLE_DEVICES to it); a
        # rank placed on a CPU share stays on the CPU even where the machine has GPUs.
        self.trainer = Trainer(config, rank, init_method, plan, device=self.device_kind(),
                               wrap_runner=wrap_runner_from_environment(), initialize=initialize)
        return RankSetup(rank, os.getpid(), str(self.trainer.device), self.trainer.data_fingerprint())

    def device_kind(self) -> str:
        """"cuda" where Ray gave this actor a GPU or it took a dead rank's, else "cpu"."""
        return "cuda" if ray.get_gpu_ids() or self.adopted_devices is not None else "cpu"

    def visible_devices(self) -> str | None:
        """The GPUs this rank uses, as CUDA_VISIBLE_DEVICES names them (None on a CPU share): what
        a warm spare needs to take this rank's place after it dies (cluster/run/rank_pool.py)."""
        if not ray.get_gpu_ids() and self.adopted_devices is None:
            return None
        return os.environ.get("CUDA_VISIBLE_DEVICES", "")

    def adopt_devices(self, visible: str) -> None:
        """Take a dead GPU rank's place: use its GPUs from the next `setup`. A warm spare starts
        with no GPU (one reserved per spare would sit idle until a failure), so Ray assigned it
        none; the dead rank's process is gone and its bundle keeps the GPU reserved, unused by any
        other actor. CUDA reads CUDA_VISIBLE_DEVICES once, when it initialises, which a spare has
        not done (importing torch does not), so setting it now is what decides its device."""
        if torch.cuda.is_initialized():
            raise RuntimeError("this actor has initialised CUDA already, so it cannot take another rank's GPU")
        os.environ["CUDA_VISIBLE_DEVICES"] = visible
        self.adopted_devices = visible

    def configure_storage(self, conf: dict) -> None:
        """The driver's object-store options (endpoint, retries, timeouts, part size — never
        credentials), so this process's checkpoint I/O uses the same policy."""
        apply_conf(conf)

    @leaves_its_group_on_failure
    def load(self, checkpoint_url: str, manifest: bytes | None = None) -> dict:
        """manifest: its bytes as the driver read them (passed by object reference, so a node
        fetches them once), sparing storage one manifest GET per rank."""
        return self.trainer.load(checkpoint_url, manifest)

    @leaves_its_group_on_failure
    def load_base(self, checkpoint_url: str) -> dict:
        """A LoRA run's frozen base weights, from the checkpoint the run names as its base."""
        return self.trainer.load_base(checkpoint_url)

    @leaves_its_group_on_failure
    def load_reference(self, checkpoint_url: str) -> dict:
        """--objective dpo without LoRA: the reference's frozen weights, from the checkpoint the run started from."""
        return self.trainer.load_reference(checkpoint_url)

    @leaves_its_group_on_failure
    def reference_logprobs(self, dataset_url: str) -> list[float]:
        """`rayshard data reference-logprobs`: the loaded model's log-probabilities of a preference dataset's examples."""
        return self.trainer.reference_logprobs(dataset_url)

    @leaves_its_group_on_failure
    def train_step(self) -> StepMetrics:
        return self.trainer.train_step()

    def full_gradients(self) -> dict:
        """Test support: loss and full gradients of the next step's batch, no optimizer step."""
        return self.trainer.full_gradients()

    @leaves_its_group_on_failure
    def save_shard(self, checkpoint_url: str, file: str) -> ChunkTable:
        return self.trainer.save_shard(checkpoint_url, file)

    def save_snapshot_shard(self, checkpoint_url: str, file: str) -> ChunkTable:
        """save_shard to the snapshot keepers. Its own I/O only, no collective: a snapshot that
        fails here (a keeper lost with its node) is skipped by the driver while this rank and its
        group train on, so the group is not left as a failed step's is."""
        return self.trainer.save_shard(checkpoint_url, file)

    @leaves_its_group_on_failure
    def stage_save(self, checkpoint_url: str, file: str) -> dict:
        """Async save: copy this rank's share of the state to CPU (all a training step waits for),
        then upload it in a background thread; the driver polls save_status."""
        trainer = self.trainer
        try:
            save = trainer.async_saver.start(trainer.model, trainer.optimizer, checkpoint_url, file,
                                             trainer.rank, trainer.pipeline_copies, trainer.stored_names)
        except BaseException:
            with self._saves_changed:  # its save_finished answers at once
                self.background_saves[checkpoint_url] = None
                self._saves_changed.notify_all()
            raise
        with self._saves_changed:
            self.background_saves[checkpoint_url] = save
            for old in list(self.background_saves)[:-SAVES_REMEMBERED]:
                del self.background_saves[old]
            self._saves_changed.notify_all()
        return save.staged

    def save_status(self, wait: bool = False, checkpoint_url: str | None = None) -> dict:
        """The save of `checkpoint_url` (None: the latest one)."""
        with self._saves_changed:
            save = self.background_saves[checkpoint_url] if checkpoint_url else list(self.background_saves.values())[-1]
        return save.status(wait)

    @ray.method(concurrency_group="inspect")
    def where_it_waits(self) -> str:
        """One line for a rank that did not answer its driver: the call it runs, for how long, and
        where (its own thread, so it answers while that call blocks in a collective)."""
        running = self.running
        if running is None:
            return "in no step, load or save"
        name, thread, since = running
        return f"in {name} for {time.monotonic() - since:.1f} s, at {where_thread_is(thread) or 'an ended thread'}"

    @ray.method(concurrency_group="save_waits")
    def save_finished(self, checkpoint_url: str, timeout_s: float) -> dict | None:
        """Answers once this rank's upload to `checkpoint_url` has ended, so the driver learns it
        at its next look without a round trip; runs beside the training calls (its own thread),
        which it only reads. After timeout_s, or once the rank is set up again or shut down: None
        if the save never started here, else its status, done False if the upload still runs
        (the driver names the rank as not finishing in its bound)."""
        deadline = time.monotonic() + timeout_s
        with self._saves_changed:
            generation = self._save_generation
            if not self._saves_changed.wait_for(
                    lambda: checkpoint_url in self.background_saves or self._save_generation != generation, timeout_s):
                return None
            save = self.background_saves.get(checkpoint_url)
        if save is None:  # it failed to start (stage_save raised), or the rank moved on to another attempt
            return None
        while not save.status()["done"] and time.monotonic() < deadline:
            save.status(wait=True, timeout_s=min(1.0, max(0.0, deadline - time.monotonic())))
            with self._saves_changed:
                if self._save_generation != generation:
                    break  # a new attempt: the driver that asked has moved on
        return save.status()

    def shutdown(self) -> None:
        with self._saves_changed:
            self._save_generation += 1
            # The previous attempt's saves go with it: a snapshot of the same step in the next
            # attempt has the same URL, and `save_finished`, which can run before `stage_save`
            # registers the new save, answered with the old one's chunks, naming files that the
            # resume had already removed (decision 228).
            self.background_saves.clear()
            self._saves_changed.notify_all()
        if self.trainer is not None:
            self.trainer.shutdown()
            self.trainer = None
            # The model, its optimizer and their meshes sit in reference cycles: collected now, the
            # run's process groups (threads, connections) and host memory go before the next run
            # builds its own, not at some later collection (decision 233).
            gc.collect()
