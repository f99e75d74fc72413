"""A trainer set up in a process that already trained compiles as a fresh process would (issue 43).

Dynamo remembers, per code object, the input sizes it has compiled a function for; a second size
makes the next compile of that code symbolic ("automatic dynamic"). The rank actors are reused
across runs and every run's blocks share `TransformerBlock.forward`, so a compiled moe-tiny run at
seq_len 8 made the next run (tiny, tp2xpp2, full AC, seq_len 32) compile its very first block with
symbolic sizes, and inductor failed with RecursionError on the stage-0 ranks
(`tests/integration/test_precision.py::test_compile_matches_eager` after
`tests/integration/test_moe_odd_layouts.py::test_compiled_blocks_with_ep_match_eager`, slow).
This checks the same state on a stand-in function, in this process, through the Trainer that a
RankActor builds for each run (docs/decisions.md 104).
"""
from __future__ import annotations

import torch

from rayshard.actors.training.trainer import Trainer
from tests.conftest import small_config
from tests.free_port import free_port


def _block(x: torch.Tensor) -> torch.Tensor:
    return x.sin() + 1


def test_a_new_trainer_forgets_the_sizes_earlier_compiles_saw(tmp_path):
    symbolic = []  # per graph dynamo compiled: whether any of its sizes is symbolic

    def recording_backend(graph_module, example_inputs):
        symbolic.append(any(isinstance(node.meta.get("example_value"), torch.SymInt)
                            for node in graph_module.graph.nodes if node.op == "placeholder"))
        return graph_module.forward

    torch._dynamo.reset()
    try:
        # An earlier run in this process compiled the code at two sizes: the second compile is
        # symbolic, which is the state this test is about (it holds in this torch).
        torch.compile(_block, backend=recording_backend)(torch.ones(2, 8))
        torch.compile(_block, backend=recording_backend)(torch.ones(2, 4))
        assert symbolic == [False, True]

        Trainer(small_config(tmp_path), 0, f"tcp://127.0.0.1:{free_port()}").shutdown()

        # A size the symbolic graph would have served: the new run compiles again, static.
        torch.compile(_block, backend=recording_backend)(torch.ones(2, 16))
        assert symbolic == [False, True, False]
    finally:
        torch._dynamo.reset()
