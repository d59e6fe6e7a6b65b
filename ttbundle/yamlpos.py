"""Safe YAML loading that remembers where every key and item came from.

``load_yaml(text, file)`` returns ``(data, positions)`` where ``positions`` maps a key path
(a tuple of str keys / int indices) to ``(line, col)``, 1-based. Only YAML's safe types are
constructed (``!!python/...`` tags are refused), duplicate keys are an error, and aliases are
allowed but the expanded document is bounded so an alias bomb ("billion laughs") is refused.
"""

from __future__ import annotations

import yaml

from .errors import Diagnostic, InvalidInput

MAX_NODES = 200_000  # expanded nodes; a real spec has a few hundred

Path = tuple


class _Walker:
    def __init__(self, file: str):
        self.file = file
        self.positions: dict[Path, tuple[int, int]] = {}
        self.count = 0
        self.constructor = yaml.SafeLoader.__new__(yaml.SafeLoader)
        yaml.constructor.SafeConstructor.__init__(self.constructor)

    def fail(self, node: yaml.Node, path: Path, message: str) -> InvalidInput:
        d = Diagnostic(message, ".".join(map(str, path)), self.file,
                       node.start_mark.line + 1, node.start_mark.column + 1)
        return InvalidInput(f"{self.file}: invalid YAML", [d])

    def walk(self, node: yaml.Node, path: Path):
        self.count += 1
        if self.count > MAX_NODES:
            raise self.fail(node, path, f"document expands to more than {MAX_NODES} nodes "
                            "(an alias bomb?); write the values out instead of nesting aliases")
        self.positions.setdefault(path, (node.start_mark.line + 1, node.start_mark.column + 1))
        if isinstance(node, yaml.MappingNode):
            out: dict = {}
            self.constructor.flatten_mapping(node)  # resolves YAML merge keys (<<)
            for key_node, value_node in node.value:
                if not isinstance(key_node, yaml.ScalarNode):
                    raise self.fail(key_node, path, "mapping keys must be plain scalars")
                key = self.scalar(key_node, path)
                if not isinstance(key, (str, int)):
                    key = str(key)
                if key in out:
                    raise self.fail(key_node, path + (key,), f"duplicate key {key!r}")
                self.positions[path + (key,)] = (key_node.start_mark.line + 1,
                                                 key_node.start_mark.column + 1)
                out[key] = self.walk(value_node, path + (key,))
            return out
        if isinstance(node, yaml.SequenceNode):
            return [self.walk(item, path + (i,)) for i, item in enumerate(node.value)]
        return self.scalar(node, path)

    def scalar(self, node: yaml.ScalarNode, path: Path):
        try:
            return self.constructor.construct_object(node, deep=True)
        except yaml.constructor.ConstructorError as e:
            raise self.fail(node, path, f"unsupported YAML tag {node.tag!r}: {e.problem}; "
                            "bundle specs use plain YAML values only") from None


def load_yaml(text: str, file: str = "<spec>") -> tuple[object, dict[Path, tuple[int, int]]]:
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        d = Diagnostic(f"{e.problem or e.context}", "", file,
                       mark.line + 1 if mark else None, mark.column + 1 if mark else None)
        raise InvalidInput(f"{file}: not valid YAML", [d]) from None
    except yaml.YAMLError as e:  # pragma: no cover - composer errors are all marked
        raise InvalidInput(f"{file}: not valid YAML: {e}") from None
    if root is None:
        return None, {}
    w = _Walker(file)
    data = w.walk(root, ())
    return data, w.positions
