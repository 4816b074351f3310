"""Zero-bubble's split backward: B computes only the input gradient, W only weight gradients.

In a stage's autograd graph, the *chain* is every node on some path from the stage output
down to its input: what B must run to send the input gradient back. Each parameter hangs
off the chain through a small private subgraph (for a linear layer, the transpose feeding
its matmul); the chain nodes where that subgraph joins are the parameter's *junctions*.
B runs the chain with hooks that keep the gradient each junction receives. W starts at the
junctions with the kept gradients and runs only the private subgraphs, which is the
weight-gradient arithmetic (x^T·dy for a linear layer), and accumulates into `.grad` so the
data-parallel hooks fire as in any backward.

Parameters that share a junction (a linear layer's weight and bias) form one group, run by
one engine call; groups are run one by one, since a call from several junctions at once
would walk the chain between them again. When a group has several junctions and one lies
below another on the chain (a weight applied twice), a hook makes the lower one use its
kept gradient in place of what the upper one passes down, so nothing is counted twice;
that group's call does walk the chain between its junctions again (plait's transformer
applies no weight twice within a stage). This is the approach of
torch.distributed.pipelining's `stage_backward_weight`, written here for plait's stages.
The graph is freed when the W work is dropped.

Two stages fall back to the plain split (B: input gradient from the retained graph; W: a
second backward from the output restricted to the parameters): the first stage, whose input
(tokens) has no gradient, so there is no chain; and stages under full recomputation, where
every W engine call would re-run the checkpointed block's forward.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge, Node


def grad_node(t: Tensor) -> Node | None:
    """The node that receives `t`'s gradient: its grad_fn, or a leaf's AccumulateGrad."""
    if t.grad_fn is not None:
        return t.grad_fn
    if not t.requires_grad:
        return None
    return t.view_as(t).grad_fn.next_functions[0][0]


def _feeders(root: Node) -> dict[Node, list[Node]]:
    """node -> the nodes that pass gradient to it (reverse edges), for the graph under root."""
    feeders: dict[Node, list[Node]] = defaultdict(list)
    seen, todo = {root}, deque([root])
    while todo:
        node = todo.popleft()
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            feeders[nxt].append(node)
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return feeders


def _climb(starts: Iterable[Node], feeders: dict, stop: set) -> tuple[set[Node], set[Node]]:
    """(nodes reached going toward the output from `starts`, the `stop` nodes met on the way)."""
    reached, met = set(), set()
    todo = deque(n for n in starts if n is not None)
    reached.update(todo)
    while todo:
        for up in feeders.get(todo.popleft(), ()):
            if up in stop:
                met.add(up)
            elif up not in reached:
                reached.add(up)
                todo.append(up)
    return reached, met


@dataclass(eq=False)  # identity: groups are merged and removed by object
class _Group:
    params: list[nn.Parameter]
    junctions: list[Node]
    kept: dict = field(default_factory=dict)  # junction -> gradients it received in B


@dataclass
class WeightWork:
    """What W needs from B: the parameter groups and the gradients kept at their junctions."""

    groups: list[_Group]

    def run(self) -> None:
        """Weight gradients, group by group, then accumulated into `.grad` by one backward
        from the leaves (AccumulateGrad, so the data-parallel hooks fire)."""
        used = [pair for group in self.groups for pair in _run_group(group)]
        self.groups = []
        if used:
            torch.autograd.backward([p for p, _ in used], [g for _, g in used])


@dataclass
class PlainWeightWork:
    """W of the plain split (the fallback above): a second backward from the stage output,
    restricted to the stage's parameters; B kept the graph (`retain_graph=True`)."""

    out: Tensor
    grad: Tensor | None
    params: list[nn.Parameter]

    def run(self) -> None:
        torch.autograd.backward(self.out, self.grad, inputs=self.params)


def split_input_backward(
    out: Tensor, grad: Tensor | None, inp: Tensor, params: list[nn.Parameter]
) -> tuple[Tensor, WeightWork]:
    """B: the gradient w.r.t. `inp`, and the work W must do later for `params`.

    Every parameter that reaches the output meets the chain at the latest at the output's
    own node (which the input reaches too), so each gets at least one junction."""
    root = grad_node(out)
    feeders = _feeders(root)
    chain, _ = _climb([grad_node(inp)], feeders, set())
    groups = _groups(params, feeders, chain)
    handles = [_keep(group, node) for group in groups for node in group.junctions]
    try:
        (grad_in,) = torch.autograd.grad(out, inp, grad, retain_graph=True)
    finally:
        for h in handles:
            h.remove()
    return grad_in, WeightWork(groups)


def _groups(params: list[nn.Parameter], feeders: dict, chain: set[Node]) -> list[_Group] | None:
    """Parameters joined into groups that share a junction (union by junction); None if a
    used parameter reaches the output without meeting the chain."""
    by_junction: dict[Node, _Group] = {}
    groups: list[_Group] = []
    for p in params:
        node = grad_node(p)
        if node is None or node not in feeders:
            continue  # unused by this stage's graph
        _, junctions = _climb([node], feeders, chain)
        merged = {id(by_junction[j]): by_junction[j] for j in junctions if j in by_junction}
        group = _Group([p], list(junctions))
        for other in merged.values():
            group.params = other.params + group.params
            group.junctions = list(dict.fromkeys(other.junctions + group.junctions))
            groups.remove(other)
        for j in group.junctions:
            by_junction[j] = group
        groups.append(group)
    return groups


def _keep(group: _Group, node: Node):
    def hook(grad_outputs: tuple) -> None:
        group.kept[node] = grad_outputs

    return node.register_prehook(hook)


def _replace_with(kept: tuple | None):
    def hook(grad_outputs: tuple) -> tuple | None:
        return kept

    return hook


def _run_group(group: _Group) -> list[tuple[nn.Parameter, Tensor]]:
    """(parameter, its weight gradient) for the group's parameters that got one."""
    edges, seeds = [], []
    for node in group.junctions:
        for i, g in enumerate(group.kept.get(node, ())):
            if g is not None:
                edges.append(GradientEdge(node, i))
                seeds.append(g)
    if not edges:
        return []
    clamps = []
    if len(group.junctions) > 1:  # a lower junction uses its kept gradient, not a new sum
        clamps = [
            node.register_prehook(_replace_with(group.kept.get(node))) for node in group.junctions
        ]
    try:
        grads = torch.autograd.grad(
            edges, group.params, seeds, retain_graph=True, allow_unused=True
        )  # retained: a group reused many times walks nodes another group needs (see top)
    finally:
        for h in clamps:
            h.remove()
    return [(p, g) for p, g in zip(group.params, grads, strict=True) if g is not None]
