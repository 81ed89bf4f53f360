"""YAML with line marks: every mapping and list remembers the line of each key and item, so
that a problem names the file, the line and the key."""
from __future__ import annotations

from typing import Any

import yaml

from ..errors import InventoryError, Problems


class Map(dict):
    """A YAML mapping: `lines` holds each key's line, `line` the mapping's own."""

    def __init__(self, data: dict, lines: dict[str, int], line: int) -> None:
        super().__init__(data)
        self.lines, self.line = lines, line


class List(list):
    """A YAML sequence: `lines` holds each item's line, `line` the list's own."""

    def __init__(self, data: list, lines: list[int], line: int) -> None:
        super().__init__(data)
        self.lines, self.line = lines, line


def compose(text: str, source: str, problems: Problems) -> Any:
    """The document as Python values (Map, List, scalars). Not YAML, or empty: InventoryError.
    A key that is not a string, or that is there twice, is noted in problems and left out."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        raise InventoryError(source, mark.line + 1 if mark else None, None,
                             f"not valid YAML: {getattr(exc, 'problem', exc)}") from None
    if root is None:
        raise InventoryError(source, None, None, "the file is empty")
    return _Located(source, problems).value(root)


class _Located:
    """A YAML node turned into Python values, remembering the line of every key and item."""

    def __init__(self, source: str, problems: Problems) -> None:
        self.source, self.problems = source, problems
        self._loader = yaml.SafeLoader("")

    def value(self, node: yaml.Node) -> Any:
        if isinstance(node, yaml.MappingNode):
            out: dict[str, Any] = {}
            lines: dict[str, int] = {}
            for knode, vnode in node.value:
                key = self._loader.construct_object(knode, deep=True)
                line = knode.start_mark.line + 1
                problem = ("keys must be strings" if not isinstance(key, str) else
                           "duplicate key" if key in out else None)
                if problem:
                    self.problems.found.append(InventoryError(self.source, line, str(key), problem))
                    continue
                out[key] = self.value(vnode)
                lines[key] = line
            return Map(out, lines, node.start_mark.line + 1)
        if isinstance(node, yaml.SequenceNode):
            return List([self.value(n) for n in node.value],
                        [n.start_mark.line + 1 for n in node.value], node.start_mark.line + 1)
        return self._loader.construct_object(node, deep=True)
