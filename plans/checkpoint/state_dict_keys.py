"""How a state dict's flattened keys map onto the manifest's (name, kind) columns, and which
non-tensor values a checkpoint keeps.

`rayshard.checkpoint` takes what people pass to torch DCP: nested dicts (and lists) whose leaves
are tensors, DTensors or plain values. Keys are flattened with "." as DCP does for
`get_state_dict` output ({"model": {...}, "optim": {"state": {fqn: {"exp_avg": ...}}}} gives
"model.layers.0.w" and "optim.state.layers.0.w.exp_avg"). The manifest names a tensor by
(name, kind), the columns the trainer's checkpoints use ("layers.0.w", "param" / "exp_avg" /
"exp_avg_sq"), so the two conventions meet:

    model.<fqn>                 -> (<fqn>, "param")
    optim.state.<fqn>.<state>   -> (<fqn>, <state>)     e.g. exp_avg, exp_avg_sq, step
    anything else               -> (<key>, "tensor")

and back. The map is one-to-one (a key "optim.state.x.param" is not an optimizer state: it maps
to (key, "tensor")), so any key round-trips, and a trainer's checkpoint and an API one of the same
model name the same tensor alike (`ckpt diff` compares them). Decision 106.

Non-tensor leaves (numbers, strings, booleans, None, and lists and dicts of them: `param_groups`,
a data loader's position) go to the manifest's run metadata as JSON, never pickled. Pure: no
torch, no I/O.
"""
from __future__ import annotations

from rayshard.plans.errors import CheckpointError

MODEL_PREFIX = "model."
OPTIMIZER_STATE_PREFIX = "optim.state."
PARAM_KIND = "param"
OTHER_KIND = "tensor"  # a tensor that is neither a model parameter nor an optimizer state
SEPARATOR = "."


def column_of(key: str) -> tuple[str, str]:
    """(name, kind) of a flattened state-dict key."""
    if key.startswith(MODEL_PREFIX) and len(key) > len(MODEL_PREFIX):
        return key[len(MODEL_PREFIX):], PARAM_KIND
    if key.startswith(OPTIMIZER_STATE_PREFIX):
        name, _, kind = key[len(OPTIMIZER_STATE_PREFIX):].rpartition(SEPARATOR)
        if name and kind and kind not in (PARAM_KIND, OTHER_KIND):
            return name, kind
    return key, OTHER_KIND


def key_of(name: str, kind: str) -> str:
    """The flattened key a manifest's (name, kind) came from (`column_of`'s inverse)."""
    if kind == PARAM_KIND:
        return MODEL_PREFIX + name
    if kind == OTHER_KIND:
        return name
    return f"{OPTIMIZER_STATE_PREFIX}{name}{SEPARATOR}{kind}"


def json_problem(value, where: str) -> str | None:
    """Why `value` cannot be kept as JSON in a manifest (naming where inside it), or None.
    Accepted: None, bool, int, float (NaN and infinities too, as Python's json writes them),
    str, and lists, tuples and str-keyed dicts of these. A tuple comes back as a list unless the
    state dict it is loaded into holds a tuple there."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return None
    if isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            problem = json_problem(item, f"{where}[{index}]")
            if problem:
                return problem
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                return f"{where} has the key {key!r} ({type(key).__name__}); JSON keeps only string keys"
            problem = json_problem(item, f"{where}.{key}")
            if problem:
                return problem
        return None
    return f"{where} is a {type(value).__module__}.{type(value).__qualname__}, neither a tensor nor a JSON value"


def check_json_value(key: str, value) -> None:
    """Raise a one-line CheckpointError when a non-tensor leaf cannot be kept as JSON."""
    problem = json_problem(value, key)
    if problem:
        raise CheckpointError(f"state dict entry {key!r}: {problem}; a checkpoint keeps non-tensor values as JSON "
                              "(never pickled). Fix: store it as a tensor, or as numbers, strings, lists and dicts")
