"""Transform rules as plain data: how a user's model plan carries its Hugging Face mapping.

A plan rides in checkpoint metadata as JSON (`plans/training/model_plan.py`), so its mapping
cannot hold rule objects. Each rule is a one-key dict, the rule's name -> its constructor
arguments in the order `plans/transforms/mapping.py` declares them (trailing defaults may be
left out; a lone argument may be given bare):

    {"rename": ["blocks.{layer}.attn_norm.weight", "transformer.h.{layer}.ln_1.weight"]}
    {"concat_rows": [["q.weight", "k.weight", "v.weight"], "qkv.weight", [64, 64, 64], 1]}
    {"transpose": "transformer.h.{layer}.attn.c_attn.weight"}
    {"unstack": ["layers.{layer}.experts.w1", "h.{layer}.experts.{expert}.w1.weight", 8]}

`encode` writes the canonical form (every argument, lists for tuples): what `decode` of any
accepted spelling gives back, so a plan compares equal after a JSON round trip. Unalias is not
spelled: it is only ever Alias's derived inverse.
"""
from __future__ import annotations

from dataclasses import fields

from rayshard.plans.transforms.mapping import (Add, Alias, Cast, ConcatRows, Drop, Mapping, RegroupRows, Rename, SplitRows, Stack,
                                         Transpose, Unstack)
from rayshard.plans.errors import CheckpointError, ConfigError

RULES = {"rename": Rename, "split_rows": SplitRows, "concat_rows": ConcatRows, "unstack": Unstack, "stack": Stack,
         "regroup_rows": RegroupRows, "transpose": Transpose,
         "cast": Cast, "add": Add, "drop": Drop, "alias": Alias}
NAMES = {rule: name for name, rule in RULES.items()}
WHERE = "model plan hf_mapping"
FIX = ('write each rule as a one-key dict such as {"rename": [source, target]} with the arguments '
       "of plans/transforms/mapping.py's rule")


def _tuples(value):
    """JSON gives lists where the rules hold tuples (targets, rows, dims, shape)."""
    return tuple(_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value


def _lists(value):
    return [_lists(v) for v in value] if isinstance(value, (list, tuple)) else value


def decode_rule(data, index: int = 0):
    """One rule from its dict; anything else is one ConfigError naming the rule and its position."""
    where = f"{WHERE}[{index}]"
    if not isinstance(data, dict) or len(data) != 1:
        raise ConfigError(where, data, "is not a one-key dict naming a rule", FIX)
    (name, arguments), = data.items()
    rule = RULES.get(name)
    if rule is None:
        raise ConfigError(where, data, f"names no rule; known: {sorted(RULES)}", FIX)
    arguments = list(arguments) if isinstance(arguments, (list, tuple)) else [arguments]
    declared = [f.name for f in fields(rule)]
    if len(arguments) > len(declared):
        raise ConfigError(where, data, f"gives {len(arguments)} arguments; {name} takes {declared}", FIX)
    try:
        return rule(*(_tuples(a) for a in arguments))
    except (TypeError, CheckpointError) as error:  # a missing argument, or the rule's own check
        raise ConfigError(where, data, f"is not a valid {name} ({error}); {name} takes {declared}", FIX) from None


def encode_rule(rule) -> dict:
    if type(rule) not in NAMES:
        raise ConfigError(WHERE, rule, f"is not a rule that can be written as data; known: {sorted(RULES)}", FIX)
    return {NAMES[type(rule)]: [_lists(getattr(rule, f.name)) for f in fields(rule)]}


def canonical(rules) -> tuple[dict, ...]:
    """The rules checked and spelled canonically (lists for tuples, every argument given)."""
    if isinstance(rules, (str, dict)) or not isinstance(rules, (list, tuple)):
        raise ConfigError(WHERE, rules, "is not a list of rules", FIX)
    return tuple(encode_rule(decode_rule(rule, index)) for index, rule in enumerate(rules))


def decode_mapping(rules) -> Mapping:
    """A strict mapping (every tensor must be covered) from the plan's rules, in the export direction."""
    return Mapping(tuple(decode_rule(rule, index) for index, rule in enumerate(rules)))
