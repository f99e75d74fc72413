"""Declarative, invertible mappings between tensor naming schemes (ours <-> Hugging Face, ...).

A mapping is a list of rules written once, in one direction. `Mapping.inverse()` derives the other
direction rule by rule (reversed order, each rule's own inverse), so export and import can never
disagree. Rules:

- Rename(source, target): patterns with placeholders that match indices, `{layer}`, `{expert}`
  (any `{word}`), e.g. "layers.{layer}.experts.{expert}.w1" <-> "model.layers.{layer}.mlp.experts.{expert}.gate_proj.weight".
  A placeholder may carry an offset, `{expert+8}` or `{layer-1}`: the name holds the index plus
  the offset, so "e.{expert}" -> "hf.{expert+8}" renumbers expert 0 as 8, and the inverse (the
  same patterns swapped) numbers 8 back as 0. A name whose index would fall below 0 does not match.
- Unstack(source, target, count) / Stack: one tensor whose dim 0 stacks `count` parts (our
  experts: [experts, out, in]) <-> `count` tensors named by the target's one extra placeholder
  (`{expert}`, offset allowed). Stacking wants exactly indices 0..count-1 (after the offset) and
  names the missing and unexpected ones: a checkpoint with an expert dropped or renumbered is
  refused, never stacked out of order.
- SplitRows / ConcatRows: a fused tensor whose rows repeat a group `groups` times, each group
  holding `rows[i]` rows of part i. That is how TP-friendly fused weights are laid out (our qkv:
  per kv head [its q heads, k, v]; our gate_up: per hidden unit [gate, up]), so any tp degree
  holds whole groups; the split recovers the plain per-part tensors in their natural order.
- RegroupRows(pattern, groups, outer, inner): rows viewed as [groups, outer, inner] (each entry
  a whole row) become [groups, inner, outer]; the inverse swaps outer and inner back. How the
  rows of a head change RoPE convention: halves (rayshard, Hugging Face: [2, head_dim/2] per
  head) <-> adjacent pairs (Meta, torchtitan: [head_dim/2, 2]), as transformers' Llama
  conversion script permutes q and k.
- Transpose(pattern, dims): swaps two dims (its own inverse).
- Cast(pattern, to, source): a dtype change, inverted by casting back (lossless only when
  widening; a float32 -> bfloat16 -> float32 trip rounds).
- Drop(pattern, ...) / Add(name, shape, dtype, fill): remove or create a tensor; a Drop can only
  be inverted when it says what to restore.
- Alias(name, of): `name` is a tied copy of `of` (tied embeddings): not written on the way out
  (the other side ties it itself), dropped on the way in after checking it equals `of`.

The same mapping applies to every state kind (weights and each optimizer moment): every rule
only moves elements, never mixes them, so a moment's elements go where their weight's go.

This module is pure: rules transform metadata (name, shape, dtype) and produce an execution plan
of steps grouped so that one group at a time can be loaded, transformed and written
(`cluster/checkpoint/transform_exec.py` runs the tensor operations).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import lru_cache

from rayshard.plans.errors import CheckpointError

# `{word}` or `{word+N}` / `{word-N}`: an index, shifted by N in the name.
PLACEHOLDER = re.compile(r"\{(\w+)([+-]\d+)?\}")


class UnmappedTensors(CheckpointError):
    """A strict mapping met tensors none of its rules takes; `names` lists them (a caller that
    knows where they came from says so in its own words)."""

    def __init__(self, names: list[str]):
        self.names = names
        super().__init__(f"no rule of the mapping covers {len(names)} tensor(s): {', '.join(names[:10])}"
                         f"{' ...' if len(names) > 10 else ''}. Fix: add a Rename (or Drop) for them")

    def __reduce__(self):
        return type(self), (self.names,)


@dataclass(frozen=True)
class Meta:
    shape: tuple[int, ...]
    dtype: str


def placeholders(pattern: str) -> set[str]:
    return {name for name, _ in PLACEHOLDER.findall(pattern)}


@lru_cache(maxsize=1024)
def _compile(pattern: str) -> tuple[re.Pattern, dict[str, int]]:
    """`{word}` matches an index; `*` matches anything; everything else is literal. Also returns
    each placeholder's offset (what the name adds to the index)."""
    out, offsets, position = [], {}, 0
    for match in re.finditer(PLACEHOLDER.pattern + r"|\*", pattern):
        out.append(re.escape(pattern[position:match.start()]))
        if match.group(1):
            out.append(f"(?P<{match.group(1)}>\\d+)")
            offsets[match.group(1)] = int(match.group(2) or 0)
        else:
            out.append(".*")
        position = match.end()
    out.append(re.escape(pattern[position:]))
    return re.compile("".join(out) + r"\Z"), offsets


def match(pattern: str, name: str) -> dict[str, str] | None:
    """The indices a name holds (offsets taken off), or None when it does not match."""
    regex, offsets = _compile(pattern)
    found = regex.match(name)
    if not found:
        return None
    captures = found.groupdict()
    for key, offset in offsets.items():
        if offset:  # unshifted indices stay as written, so a rename keeps them character for character
            index = int(captures[key]) - offset
            if index < 0:
                return None
            captures[key] = str(index)
    return captures


def fill(pattern: str, captures: dict[str, str]) -> str:
    missing = placeholders(pattern) - set(captures)
    if missing:
        raise CheckpointError(f"pattern {pattern!r} needs {sorted(missing)} but the matched name only gives {sorted(captures)}")

    def index(found: re.Match) -> str:
        if not found.group(2):
            return captures[found.group(1)]
        shifted = int(captures[found.group(1)]) + int(found.group(2))
        if shifted < 0:
            raise CheckpointError(f"pattern {pattern!r} would name index {shifted} for {found.group(1)}="
                                  f"{captures[found.group(1)]}; Fix: give the offset so that every index stays 0 or more")
        return str(shifted)
    return PLACEHOLDER.sub(index, pattern)


def _same_placeholders(a: str, b: str, rule: str) -> None:
    if placeholders(a) != placeholders(b):
        raise CheckpointError(f"{rule}: {a!r} and {b!r} must use the same placeholders, or the mapping cannot be inverted")


@dataclass(frozen=True)
class Application:
    """One rule applied to concrete names: consumes `inputs`, produces `outputs`."""

    rule: object
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


# ---- rules --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rename:
    source: str
    target: str

    def __post_init__(self):
        _same_placeholders(self.source, self.target, "Rename")

    def inverse(self) -> "Rename":
        return Rename(self.target, self.source)

    def apply(self, state: dict[str, Meta]) -> list[tuple[Application, dict[str, Meta]]]:
        return [(Application(self, (name,), (fill(self.target, captures),)), {fill(self.target, captures): state[name]})
                for name in list(state) if (captures := match(self.source, name)) is not None]


def _sized(state: dict[str, Meta], pattern: str, rows: int, problem):
    """(name, captures, meta) of each tensor matching `pattern`, which must have `rows` rows (dim 0);
    problem(meta) says what does not fit."""
    for name in list(state):
        captures = match(pattern, name)
        if captures is None:
            continue
        meta = state[name]
        if not meta.shape or meta.shape[0] != rows:
            raise CheckpointError(f"{name}: {problem(meta)}; the model config does not match the tensor")
        yield name, captures, meta


@dataclass(frozen=True)
class SplitRows:
    source: str
    targets: tuple[str, ...]
    rows: tuple[int, ...]  # rows of each part within one group
    groups: int

    def __post_init__(self):
        if len(self.targets) != len(self.rows) or self.groups < 1 or min(self.rows) < 1:
            raise CheckpointError(f"SplitRows {self.source}: need one positive row count per target and groups >= 1")
        for target in self.targets:
            _same_placeholders(self.source, target, "SplitRows")

    def inverse(self) -> "ConcatRows":
        return ConcatRows(self.targets, self.source, self.rows, self.groups)

    def apply(self, state):
        results = []
        for name, captures, meta in _sized(state, self.source, self.groups * sum(self.rows), lambda meta: (
                f"{meta.shape[:1]} rows cannot be split into {self.groups} groups of {list(self.rows)} rows")):
            outputs = tuple(fill(t, captures) for t in self.targets)
            produced = {out: Meta((self.groups * rows, *meta.shape[1:]), meta.dtype) for out, rows in zip(outputs, self.rows)}
            results.append((Application(self, (name,), outputs), produced))
        return results


@dataclass(frozen=True)
class ConcatRows:
    sources: tuple[str, ...]
    target: str
    rows: tuple[int, ...]
    groups: int

    def inverse(self) -> SplitRows:
        return SplitRows(self.target, self.sources, self.rows, self.groups)

    def apply(self, state):
        results = []
        for name in list(state):
            captures = match(self.sources[0], name)
            if captures is None:
                continue
            inputs = tuple(fill(s, captures) for s in self.sources)
            absent = [i for i in inputs if i not in state]
            if absent:
                raise CheckpointError(f"{self.target}: concatenating {list(inputs)} but {absent} are missing")
            metas = [state[i] for i in inputs]
            for meta, rows, source in zip(metas, self.rows, inputs):
                if not meta.shape or meta.shape[0] != self.groups * rows or meta.shape[1:] != metas[0].shape[1:] \
                        or meta.dtype != metas[0].dtype:
                    raise CheckpointError(f"{source}: shape {list(meta.shape)} {meta.dtype} does not fit {self.groups} "
                                          f"groups of {rows} rows like {inputs[0]} {list(metas[0].shape)}")
            target = fill(self.target, captures)
            shape = (self.groups * sum(self.rows), *metas[0].shape[1:])
            results.append((Application(self, inputs, (target,)), {target: Meta(shape, metas[0].dtype)}))
        return results


def _stacking_placeholder(whole: str, parts: str, count: int, rule: str) -> str:
    """The one placeholder `parts` has beyond `whole`'s: it numbers the parts of dim 0."""
    extra = placeholders(parts) - placeholders(whole)
    if len(extra) != 1 or not placeholders(whole) <= placeholders(parts):
        raise CheckpointError(f"{rule}: {parts!r} must use the placeholders of {whole!r} plus exactly one that numbers "
                              "the parts (e.g. {expert}), or the mapping cannot be inverted")
    if count < 1:
        raise CheckpointError(f"{rule} {whole}: count must be 1 or more, not {count}")
    return extra.pop()


@dataclass(frozen=True)
class Unstack:
    """[count, ...] -> count tensors [...], part i named with the extra placeholder = i (plus its offset)."""

    source: str
    target: str
    count: int

    def __post_init__(self):
        _stacking_placeholder(self.source, self.target, self.count, "Unstack")

    def inverse(self) -> "Stack":
        return Stack(self.target, self.source, self.count)

    def apply(self, state):
        index = _stacking_placeholder(self.source, self.target, self.count, "Unstack")
        results = []
        for name, captures, meta in _sized(state, self.source, self.count, lambda meta: (
                f"dim 0 of {list(meta.shape)} cannot be unstacked into {self.count} tensors {self.target}")):
            outputs = tuple(fill(self.target, {**captures, index: str(i)}) for i in range(self.count))
            results.append((Application(self, (name,), outputs), {out: Meta(meta.shape[1:], meta.dtype) for out in outputs}))
        return results


@dataclass(frozen=True)
class Stack:
    """count tensors named by the extra placeholder (indices 0..count-1 after the offset) -> [count, ...]."""

    source: str
    target: str
    count: int

    def __post_init__(self):
        _stacking_placeholder(self.target, self.source, self.count, "Stack")

    def inverse(self) -> Unstack:
        return Unstack(self.target, self.source, self.count)

    def apply(self, state):
        index = _stacking_placeholder(self.target, self.source, self.count, "Stack")
        stacks: dict[str, dict[int, str]] = {}  # target name -> index -> part name
        for name in list(state):
            captures = match(self.source, name)
            if captures is not None:
                stacks.setdefault(fill(self.target, captures), {})[int(captures.pop(index))] = name
        results = []
        for target, parts in stacks.items():
            missing = sorted(set(range(self.count)) - set(parts))
            unexpected = sorted(parts[i] for i in set(parts) - set(range(self.count)))
            if missing or unexpected:
                captures = match(self.source, next(iter(parts.values())))
                absent = [fill(self.source, {**captures, index: str(i)}) for i in missing]
                raise CheckpointError(f"{target}: stacking {self.count} tensors {self.source} (indices 0..{self.count - 1}) but "
                                      + "; ".join(filter(None, (absent and f"missing {', '.join(absent)}",
                                                                unexpected and f"unexpected {', '.join(unexpected)}")))
                                      + "; Fix: give every part exactly once under its own index (a model config with "
                                      "this many parts, and no part dropped or renumbered)")
            inputs = tuple(parts[i] for i in range(self.count))
            first = state[inputs[0]]
            for part in inputs[1:]:
                if state[part] != first:
                    raise CheckpointError(f"{part}: shape {list(state[part].shape)} {state[part].dtype} differs from "
                                          f"{inputs[0]} {list(first.shape)} {first.dtype}; stacked parts must agree")
            results.append((Application(self, inputs, (target,)), {target: Meta((self.count, *first.shape), first.dtype)}))
        return results


@dataclass(frozen=True)
class RegroupRows:
    pattern: str
    groups: int
    outer: int
    inner: int

    def __post_init__(self):
        if min(self.groups, self.outer, self.inner) < 1:
            raise CheckpointError(f"RegroupRows {self.pattern}: groups, outer and inner must be 1 or more")

    def inverse(self) -> "RegroupRows":
        return RegroupRows(self.pattern, self.groups, self.inner, self.outer)

    def apply(self, state):
        rows = self.groups * self.outer * self.inner
        return [(Application(self, (name,), (name,)), {name: meta})
                for name, _, meta in _sized(state, self.pattern, rows, lambda meta: (
                    f"{meta.shape[:1]} rows are not {self.groups} groups of {self.outer} x {self.inner} rows"))]


@dataclass(frozen=True)
class Transpose:
    pattern: str
    dims: tuple[int, int] = (0, 1)

    def inverse(self) -> "Transpose":
        return self

    def apply(self, state):
        results = []
        for name in list(state):
            if match(self.pattern, name) is None:
                continue
            shape = list(state[name].shape)
            a, b = self.dims
            shape[a], shape[b] = shape[b], shape[a]
            results.append((Application(self, (name,), (name,)), {name: Meta(tuple(shape), state[name].dtype)}))
        return results


@dataclass(frozen=True)
class Cast:
    pattern: str
    to: str
    source: str  # the dtype it casts from: needed to cast back

    def inverse(self) -> "Cast":
        return Cast(self.pattern, self.source, self.to)

    def apply(self, state):
        results = []
        for name in list(state):
            if match(self.pattern, name) is None or state[name].dtype != self.source:
                continue
            results.append((Application(self, (name,), (name,)), {name: Meta(state[name].shape, self.to)}))
        return results


@dataclass(frozen=True)
class Add:
    name: str
    shape: tuple[int, ...]
    dtype: str
    fill: float

    def inverse(self) -> "Drop":
        return Drop(self.name, self.shape, self.dtype, self.fill)

    def apply(self, state):
        if self.name in state:
            return []
        return [(Application(self, (), (self.name,)), {self.name: Meta(tuple(self.shape), self.dtype)})]


@dataclass(frozen=True)
class Drop:
    pattern: str
    shape: tuple[int, ...] | None = None  # what Add restores on the way back; None: not invertible
    dtype: str | None = None
    fill: float | None = None

    def inverse(self) -> Add:
        if self.shape is None or self.dtype is None or self.fill is None or placeholders(self.pattern) or "*" in self.pattern:
            raise CheckpointError(f"Drop({self.pattern!r}) cannot be inverted: it does not say what to restore. "
                                  "Fix: give shape, dtype and fill (and a concrete name), or use the mapping in one direction only")
        return Add(self.pattern, tuple(self.shape), self.dtype, self.fill)

    def apply(self, state):
        return [(Application(self, (name,), ()), {}) for name in list(state) if match(self.pattern, name) is not None]


@dataclass(frozen=True)
class Alias:
    """`name` is a tied copy of `of`. Forward: not produced (the other side ties it itself);
    inverse (`Unalias`): consumed when present, after the executor checks it equals `of`."""

    name: str
    of: str

    def inverse(self) -> "Unalias":
        return Unalias(self.name, self.of)

    def apply(self, state):
        return []


@dataclass(frozen=True)
class Unalias:
    name: str
    of: str

    def inverse(self) -> Alias:
        return Alias(self.name, self.of)

    def apply(self, state):
        if self.name not in state:
            return []
        if self.of not in state:
            raise CheckpointError(f"{self.name} is declared a tied copy of {self.of}, which is missing")
        return [(Application(self, (self.name, self.of), (self.of,)), {self.of: state[self.of]})]


Rule = Rename | SplitRows | ConcatRows | RegroupRows | Unstack | Stack | Transpose | Cast | Add | Drop | Alias | Unalias


# ---- the mapping and its plan -------------------------------------------------------------------


@dataclass(frozen=True)
class Group:
    """Source tensors that must be loaded together, the steps that transform them, and what comes out."""

    sources: tuple[str, ...]
    steps: tuple[Application, ...]
    outputs: tuple[str, ...]


@dataclass
class MappingPlan:
    outputs: dict[str, Meta]  # final name -> meta, in output order
    groups: list[Group]
    unmapped: list[str] = field(default_factory=list)  # source names no rule touched

    def group_of(self) -> dict[str, Group]:
        return {name: group for group in self.groups for name in group.outputs}


@dataclass(frozen=True)
class Mapping:
    rules: tuple
    # Names no rule covers: strict mappings refuse them (an export must not silently pass a
    # tensor through under a name the other side does not know).
    strict: bool = True

    def inverse(self) -> "Mapping":
        return Mapping(tuple(rule.inverse() for rule in reversed(self.rules)), self.strict)

    def plan(self, sources: dict[str, Meta]) -> MappingPlan:
        state = dict(sources)
        touched: set[str] = set()
        origin = {name: {name} for name in sources}  # name -> the source names it derives from
        steps: list[Application] = []
        for rule in self.rules:
            for application, produced in rule.apply(state):
                roots = set().union(*(origin.get(n, {n}) for n in application.inputs))
                for name in application.inputs:
                    state.pop(name, None)
                for name, meta in produced.items():
                    if name in state:
                        raise CheckpointError(f"{type(rule).__name__} would produce {name}, which already exists")
                    state[name] = meta
                    origin[name] = set(roots)
                touched |= set(application.inputs) | set(produced)
                steps.append(application)
        unmapped = sorted(name for name in sources if name in state and name not in touched)
        if self.strict and unmapped:
            raise UnmappedTensors(unmapped)
        return MappingPlan(dict(state), _groups(sources, steps, origin, state), unmapped)


def _groups(sources: dict[str, Meta], steps: list[Application], origin: dict, final: dict) -> list[Group]:
    """Union the sources that feed a common step, so each group is loaded and written on its own."""
    parent = {name: name for name in sources}

    def root(name):
        while parent[name] != name:
            parent[name] = parent[parent[name]]
            name = parent[name]
        return name

    step_roots = []
    for step in steps:
        roots = sorted(set().union(*(origin.get(n, {n}) for n in step.inputs)) & set(sources)) if step.inputs else []
        for other in roots[1:]:
            parent[root(other)] = root(roots[0])
        step_roots.append(roots)
    members: dict[str, list[str]] = {}
    for name in sources:
        members.setdefault(root(name), []).append(name)
    by_root: dict[str, list[Application]] = {r: [] for r in members}
    created: list[Application] = []  # Add steps: no source
    for step, roots in zip(steps, step_roots):
        (by_root[root(roots[0])] if roots else created).append(step)
    outputs_by_root: dict[str, list[str]] = {r: [] for r in members}
    extra: list[str] = []
    for name in final:
        roots = sorted(origin.get(name, set()) & set(sources))
        (outputs_by_root[root(roots[0])] if roots else extra).append(name)
    groups = [Group(tuple(members[r]), tuple(by_root[r]), tuple(outputs_by_root[r])) for r in members]
    if created or extra:
        groups.append(Group((), tuple(created), tuple(extra)))
    return groups

