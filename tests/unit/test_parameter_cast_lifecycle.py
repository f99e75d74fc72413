"""The casts' lifecycle (actors/parallel/parameter_casts.py): modules read bf16 casts during a forward
and its backward, everything else sees the float32 masters, and no cast outlives the step it was
made for. The numbers against FSDP2 are tests/integration/test_parameter_casts.py's."""
from __future__ import annotations

import pytest
import torch

from rayshard.actors.parallel.parameter_casts import cast_parameters
from rayshard.actors.model.transformer import Transformer
from rayshard.actors.training.step_runner import microbatch_loss
from rayshard.plans.training.model_spec import preset


def _model(**overrides):
    torch.manual_seed(0)
    model = Transformer(preset("tiny", **overrides))
    cast_parameters(model, torch.bfloat16)
    return model


def _shadowed(model) -> int:
    return sum(name in module.__dict__ for module in model.modules() for name in module._parameters)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied-embeddings"])
def test_modules_read_casts_in_the_forward_while_parameters_stay_float32(tied):
    model = _model(tie_embeddings=tied)
    seen = {}

    def look(module, args, output):
        seen["weight"] = module.weight.dtype
        seen["input"] = args[0].dtype
        seen["parameters"] = {param.dtype for param in model.parameters()}

    model.layers["0"].feed_forward.down.register_forward_hook(look)
    tokens = torch.randint(0, 256, (2, 16))
    logits = model(tokens)
    assert logits.dtype == torch.bfloat16
    assert seen == {"weight": torch.bfloat16, "input": torch.bfloat16, "parameters": {torch.float32}}
    assert {value.dtype for value in model.state_dict().values()} == {torch.float32}
    assert _shadowed(model) > 0  # kept for the backward (an AC recompute reads them)

    microbatch_loss(logits, torch.randint(0, 256, (2, 16)), 1).backward()
    assert _shadowed(model) == 0
    grads = {name: param.grad for name, param in model.named_parameters()}
    assert all(grad is not None and grad.dtype == torch.float32 for grad in grads.values())
    # bf16 gradients turned into float32: every value sits on bf16's grid.
    assert all(torch.equal(grad, grad.bfloat16().float()) for grad in grads.values())


def test_a_forward_without_gradients_drops_its_casts():
    model = _model()
    with torch.no_grad():
        model(torch.randint(0, 256, (1, 8)))
    assert _shadowed(model) == 0


def test_each_forward_casts_the_current_weights():
    """An update between two forwards (the optimizer's) is what the next forward computes with."""
    model = _model()
    tokens = torch.randint(0, 256, (1, 8))
    with torch.no_grad():
        before = model(tokens)
        for param in model.parameters():
            param.mul_(0.5)
        after = model(tokens)
    assert not torch.equal(before, after)
    torch.manual_seed(0)
    reference = Transformer(preset("tiny"))
    cast_parameters(reference, torch.bfloat16)
    with torch.no_grad():
        for param in reference.parameters():
            param.mul_(0.5)
        assert torch.equal(reference(tokens), after)
