"""How much a parsed GBNF grammar costs llama.cpp's grammar engine (sans-I/O).

:func:`measure` walks the nodes :class:`~.gbnf.GbnfParser` made: the grammar
once every ``{m,n}`` is unrolled, the parse stacks a rule opens before its
first character and how deep its rules go there, and the product of counted
repetitions nested in one another — each beyond its bound refused
(:class:`~.gbnf.GrammarRefused`) with the rule it was found in. The figures
behind each bound are in docs/operations.md, "Grammar and schema bounds".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final

from .gbnf import UNBOUNDED, GbnfParser, GrammarRefused, Item

__all__ = [
    "MAX_EXPANDED_ELEMENTS",
    "MAX_FANOUT",
    "MAX_REPETITION_PRODUCT",
    "MAX_START_DEPTH",
    "GrammarShape",
    "measure",
]

#: Nested counted repetitions: the product of their counts along any path of
#: groups and rule references (one level alone is not counted).
MAX_REPETITION_PRODUCT: Final = 256
#: Grammar elements once llama.cpp has unrolled every ``{m,n}`` (memory and
#: parse time).
MAX_EXPANDED_ELEMENTS: Final = 1_000_000
#: Parse stacks a rule opens before it reads a character (its alternatives,
#: and through optional items theirs): the stacks its first character is
#: checked against.
MAX_FANOUT: Final = 4096
#: Rule references one after the other before the first character (each is a
#: frame of every parse stack; llama.cpp copies stacks whole).
MAX_START_DEPTH: Final = 1000


@dataclass
class GrammarShape:
    """What :func:`~.grammar_bounds.measure_gbnf` found (tests, the bounds' messages)."""

    bytes: int = 0
    rules: int = 0
    nesting: int = 0
    #: The largest product of nested counted repetitions (0: none nested).
    repetition_product: int = 0
    expanded_elements: int = 0
    fanout: int = 0
    start_depth: int = 0
    #: Where the worst of each measure was found (a rule's name).
    where: dict[str, str] = field(default_factory=dict)


def measure(parser: GbnfParser) -> GrammarShape:
    """The parsed grammar's shape; raises :class:`~.gbnf.GrammarRefused` beyond a bound."""
    nodes = parser.nodes
    count = len(nodes)
    rules = parser.rules
    shape = GrammarShape(rules=len(rules), nesting=parser.nesting)
    names = parser.node_names

    def target(item: Item) -> int:
        return int(rules[item[1]]) if item[0] == "r" else int(item[1])

    # Unrolled size: every item copied as often as llama.cpp copies it.
    expanded = 0
    for node in nodes:
        for alternative in node:
            expanded += 1
            for item in alternative:
                copies = item[3] if item[3] != UNBOUNDED else item[2] + 1
                expanded += item[5] * max(1, copies) * (2 if item[2] != item[3] else 1)
        if expanded > MAX_EXPANDED_ELEMENTS:
            raise GrammarRefused(
                f"unrolls to more than {MAX_EXPANDED_ELEMENTS} grammar elements "
                f"(at most {MAX_EXPANDED_ELEMENTS}; repetition counts multiply what they repeat)"
            )
    shape.expanded_elements = expanded

    nullable = _nullable(nodes, target)

    def item_nullable(item: Item) -> bool:
        return bool(item[2] == 0 or (item[0] != "t" and nullable[target(item)]))

    # Before the first character: the rule references each node may enter
    # (through optional items), in order. A cycle is left recursion, which
    # llama.cpp refuses too.
    first_edges: list[list[tuple[int, int]]] = [[] for _ in range(count)]
    first_terms: list[int] = [0] * count
    for index, node in enumerate(nodes):
        for alternative in node:
            for item in alternative:
                copies = item[3] if item[3] != UNBOUNDED else item[2] + 1
                # Optional copies of an item that may be empty each open its stacks.
                weight = max(1, copies) if item[0] != "t" and nullable[target(item)] else 1
                if item[0] == "t":
                    first_terms[index] += weight
                else:
                    first_edges[index].append((target(item), weight))
                if not item_nullable(item):
                    break
    order = _topological(first_edges, names)
    fanout = [0] * count
    depth = [0] * count
    for index in order:  # every node after those it enters
        stacks = first_terms[index]
        deepest = 0
        for child, weight in first_edges[index]:
            stacks += weight * fanout[child]
            deepest = max(deepest, depth[child] + 1)
        fanout[index] = min(stacks, MAX_FANOUT + 1)
        depth[index] = deepest
        if fanout[index] > MAX_FANOUT:
            raise GrammarRefused(
                f"opens more than {MAX_FANOUT} parse stacks before one character (in rule "
                f"{names[index][:40]!r}: its alternatives, and through optional items theirs; "
                f"at most {MAX_FANOUT})"
            )
        if depth[index] > MAX_START_DEPTH:
            raise GrammarRefused(
                f"enters more than {MAX_START_DEPTH} rules one inside the other before one "
                f"character (from rule {names[index][:40]!r}; at most {MAX_START_DEPTH})"
            )
    shape.fanout = max(fanout, default=0)
    shape.start_depth = max(depth, default=0)
    shape.repetition_product = _repetition_product(nodes, target, names)
    return shape


def _nullable(nodes: list[list[list[Item]]], target: Any) -> list[bool]:
    """Which nodes can match the empty text (a worklist, linear)."""
    count = len(nodes)
    nullable = [False] * count
    # For each alternative: how many of its items are not yet known to be empty.
    pending: list[int] = []
    owner: list[int] = []
    waiting: list[list[int]] = [[] for _ in range(count)]
    ready: list[int] = []
    for index, node in enumerate(nodes):
        for alternative in node:
            alt = len(pending)
            owner.append(index)
            left = 0
            for item in alternative:
                if item[2] == 0:
                    continue
                if item[0] == "t":
                    left = -1  # never empty
                    break
                left += 1
                waiting[target(item)].append(alt)
            pending.append(left)
            if left == 0:
                ready.append(index)
    while ready:
        index = ready.pop()
        if nullable[index]:
            continue
        nullable[index] = True
        for alt in waiting[index]:
            if pending[alt] > 0:
                pending[alt] -= 1
                if pending[alt] == 0:
                    ready.append(owner[alt])
    return nullable


def _topological(edges: list[list[tuple[int, int]]], names: list[str]) -> list[int]:
    """Nodes, each after every node it has an edge to; a cycle is refused."""
    count = len(edges)
    state = [0] * count  # 0 new, 1 on the path, 2 done
    order: list[int] = []
    for start in range(count):
        if state[start]:
            continue
        stack = [(start, 0)]
        state[start] = 1
        while stack:
            node, i = stack[-1]
            if i < len(edges[node]):
                stack[-1] = (node, i + 1)
                child = edges[node][i][0]
                if state[child] == 1:
                    raise GrammarRefused(
                        f"could not be parsed: rule {names[child][:40]!r} is left-recursive "
                        "(it can reach itself before a character)",
                        "bad_request",
                    )
                if state[child] == 0:
                    state[child] = 1
                    stack.append((child, 0))
            else:
                state[node] = 2
                order.append(node)
                stack.pop()
    return order


def _repetition_product(nodes: list[list[list[Item]]], target: Any, names: list[str]) -> int:
    """The largest product of counted repetitions nested in one another (through
    groups and rule references), over two levels or more; a counted repetition
    that contains its own rule is unbounded."""
    count = len(nodes)
    edges: list[list[tuple[int, int]]] = [[] for _ in range(count)]
    for index, node in enumerate(nodes):
        for alternative in node:
            for item in alternative:
                # A counted repetition unrolls into a chain of rules: its
                # position in the chain (0 to n) is one more frame of state.
                factor = 1
                if item[4]:
                    factor = (item[3] if item[3] != UNBOUNDED else item[2]) + 1
                if item[0] == "t":
                    if factor > 1:
                        edges[index].append((-1, factor))
                    continue
                edges[index].append((target(item), factor))
    components = _components([[e for e in out if e[0] >= 0] for out in edges])
    component_of = [0] * count
    for number, members in enumerate(components):
        for member in members:
            component_of[member] = number
    cap = MAX_REPETITION_PRODUCT + 1
    # single[c]: the largest product below a component (one level or more);
    # nested[c]: the same over two levels or more (0: none).
    single = [1] * len(components)
    nested = [0] * len(components)
    for number, members in enumerate(components):  # reverse topological order
        best_single, best_nested = 1, 0
        for member in members:
            for child, factor in edges[member]:
                if child < 0:  # a counted terminal: one level
                    best_single = max(best_single, min(cap, factor))
                    continue
                inner = component_of[child]
                if inner == number:
                    if factor > 1:
                        raise GrammarRefused(
                            f"repeats a count of {factor} around rule {names[member][:40]!r}, "
                            "which contains itself: the counts multiply without bound "
                            f"(nested counted repetitions are served up to a product of "
                            f"{MAX_REPETITION_PRODUCT})"
                        )
                    continue
                best_single = max(best_single, min(cap, factor * single[inner]))
                best_nested = max(best_nested, nested[inner])
                if factor > 1 and single[inner] > 1:
                    best_nested = max(best_nested, min(cap, factor * single[inner]))
        single[number], nested[number] = best_single, best_nested
        if best_nested > MAX_REPETITION_PRODUCT:
            raise GrammarRefused(
                f"nests counted repetitions whose counts multiply to more than "
                f"{MAX_REPETITION_PRODUCT} (in rule {names[members[0]][:40]!r}; at most "
                f"{MAX_REPETITION_PRODUCT}: llama.cpp's grammar engine keeps a parse stack "
                "per way to split the text among them)"
            )
    return max(nested, default=0)


def _components(edges: list[list[tuple[int, int]]]) -> list[list[int]]:
    """Strongly connected components (Tarjan, iteratively), each after those it reaches."""
    count = len(edges)
    index_of = [-1] * count
    low = [0] * count
    on_stack = [False] * count
    stack: list[int] = []
    components: list[list[int]] = []
    counter = 0
    for start in range(count):
        if index_of[start] >= 0:
            continue
        work = [(start, 0)]
        index_of[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack[start] = True
        while work:
            node, i = work[-1]
            if i < len(edges[node]):
                work[-1] = (node, i + 1)
                child = edges[node][i][0]
                if index_of[child] < 0:
                    index_of[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack[child] = True
                    work.append((child, 0))
                elif on_stack[child]:
                    low[node] = min(low[node], index_of[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index_of[node]:
                members = []
                while True:
                    member = stack.pop()
                    on_stack[member] = False
                    members.append(member)
                    if member == node:
                        break
                components.append(members)
    return components
