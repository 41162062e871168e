"""The elementary cycles of a graph's stages, which the credit rule checks one by one."""

from __future__ import annotations

from collections.abc import Iterator

MAX_CYCLES_CHECKED = 10_000


def simple_cycles(order: list[str], succ: dict[str, list[str]]) -> Iterator[list[str]]:
    """Elementary cycles of a small directed graph, each starting at its first node in `order`.

    For each start node s, a depth-first search over nodes after s in `order` finds every
    path back to s, so each cycle is found exactly once. Stops after MAX_CYCLES_CHECKED.
    """
    index = {name: i for i, name in enumerate(order)}
    found = 0
    for start in order:
        s = index[start]
        stack: list[tuple[str, Iterator[str]]] = [(start, iter(succ[start]))]
        path = [start]
        on_path = {start}
        while stack:
            _node, children = stack[-1]
            advanced = False
            for child in children:
                if child == start:
                    yield list(path)
                    found += 1
                    if found >= MAX_CYCLES_CHECKED:
                        return
                elif index[child] > s and child not in on_path:
                    stack.append((child, iter(succ[child])))
                    path.append(child)
                    on_path.add(child)
                    advanced = True
                    break
            if not advanced:
                stack.pop()
                on_path.discard(path.pop())
