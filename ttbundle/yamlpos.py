"""Safe YAML loading that remembers where every key and item came from.

``load_yaml(text, file)`` returns ``(data, positions)`` where ``positions`` maps a key path
(a tuple of str keys / int indices) to ``(line, col)``, 1-based. Only YAML's safe types are
constructed (``!!python/...`` tags are refused), duplicate keys are an error, and aliases are
allowed but the expanded document is bounded so an alias bomb ("billion laughs") is refused.
Merge keys (``<<``) follow YAML: explicit keys win, then earlier merged mappings over later ones.
"""

from __future__ import annotations

import math
import re

import yaml

from .errors import Diagnostic, InvalidInput

MAX_NODES = 200_000  # expanded nodes; a real spec has a few hundred
MAX_DEPTH = 64  # nesting levels; a real spec has about 5
MAX_SCALAR_CHARS = 4096  # one value (a path, a name, a number); PATH_MAX is 4096
MAX_INT = 2**63 - 1  # numbers are bounded before anything uses them

Path = tuple
_MAP, _SEQ = "tag:yaml.org,2002:map", "tag:yaml.org,2002:seq"
_MERGE = "tag:yaml.org,2002:merge"
_STR = "tag:yaml.org,2002:str"
#: a number with an exponent and no dot (`1e-5`, `2E+3`): YAML 1.2's float, PyYAML's string
_EXP_FLOAT = re.compile(r"[-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)[eE][-+]?[0-9]+")


class _SpecConstructor(yaml.constructor.SafeConstructor):
    """YAML's safe scalar types, built from SafeConstructor's own methods into a table of our
    own: other libraries edit PyYAML's shared table in place (lm-format-enforcer, which vLLM
    imports for structured output, makes every timestamp a string for the whole process)."""

    yaml_constructors: dict = {}


for _tag in ("null", "bool", "int", "float", "binary", "timestamp", "str"):
    _SpecConstructor.add_constructor(f"tag:yaml.org,2002:{_tag}",
                                     getattr(yaml.constructor.SafeConstructor, f"construct_yaml_{_tag}"))
_SpecConstructor.add_constructor(None, yaml.constructor.SafeConstructor.construct_undefined)


class _Walker:
    def __init__(self, file: str):
        self.file = file
        self.positions: dict[Path, tuple[int, int]] = {}
        self.count = 0
        self.depth = 0
        self.constructor = _SpecConstructor()

    def fail(self, node: yaml.Node, path: Path, message: str) -> InvalidInput:
        d = Diagnostic(message, ".".join(map(str, path)), self.file,
                       node.start_mark.line + 1, node.start_mark.column + 1)
        return InvalidInput(f"{self.file}: invalid YAML", [d])

    def walk(self, node: yaml.Node, path: Path):
        self.depth += 1
        try:
            return self._walk(node, path)
        finally:
            self.depth -= 1

    def _walk(self, node: yaml.Node, path: Path):
        self.count += 1
        if self.count > MAX_NODES:
            raise self.fail(node, path, f"document expands to more than {MAX_NODES} nodes "
                            "(an alias bomb?); write the values out instead of nesting aliases")
        if self.depth > MAX_DEPTH:
            raise self.fail(node, path, f"nested more than {MAX_DEPTH} levels deep (a recursive "
                            "alias?)")
        self.positions.setdefault(path, (node.start_mark.line + 1, node.start_mark.column + 1))
        if isinstance(node, yaml.MappingNode):
            self.check_tag(node, path, _MAP)
            out: dict = {}
            merges = []
            for key_node, value_node in node.value:
                if key_node.tag == _MERGE:  # YAML merge key (<<): resolved below, explicit keys win
                    merges.append(value_node)
                    continue
                if not isinstance(key_node, yaml.ScalarNode):
                    raise self.fail(key_node, path, "mapping keys must be plain scalars")
                key = self.scalar(key_node, path)
                if not isinstance(key, str):  # `1:`, `true:`, `null:` keys: keep the text as written
                    key = str(key_node.value)
                if key in out:
                    raise self.fail(key_node, path + (key,), f"duplicate key {key!r}")
                self.positions[path + (key,)] = (key_node.start_mark.line + 1,
                                                 key_node.start_mark.column + 1)
                out[key] = self.walk(value_node, path + (key,))
            for value_node in merges:
                sources = value_node.value if isinstance(value_node, yaml.SequenceNode) else [value_node]
                for src in sources:  # earlier sources win over later ones (YAML merge spec)
                    if not isinstance(src, yaml.MappingNode):
                        raise self.fail(src, path, "`<<` merges a mapping or a list of mappings")
                    saved, self.positions = self.positions, {}
                    merged = self.walk(src, path)
                    merged_pos, self.positions = self.positions, saved
                    for p, pos in merged_pos.items():  # positions of the keys adopted below
                        if len(p) > len(path) and p[len(path)] not in out:
                            self.positions.setdefault(p, pos)
                    for k, v in merged.items():
                        out.setdefault(k, v)
            return out
        if isinstance(node, yaml.SequenceNode):
            self.check_tag(node, path, _SEQ)
            return [self.walk(item, path + (i,)) for i, item in enumerate(node.value)]
        return self.scalar(node, path)

    def check_tag(self, node: yaml.Node, path: Path, plain: str) -> None:
        if node.tag != plain:  # e.g. !!python/object, !!python/object/apply, !!set, !!omap
            raise self.fail(node, path, f"unsupported YAML tag {node.tag!r}; bundle specs use plain "
                            "YAML values only")

    def scalar(self, node: yaml.ScalarNode, path: Path):
        if len(node.value) > MAX_SCALAR_CHARS:
            raise self.fail(node, path, f"value of {len(node.value):,} characters (at most "
                            f"{MAX_SCALAR_CHARS:,}); a spec value is a name, a number or a path")
        try:
            value = self.constructor.construct_object(node, deep=True)
        except yaml.constructor.ConstructorError as e:
            raise self.fail(node, path, f"unsupported YAML tag {node.tag!r}: {e.problem}; "
                            "bundle specs use plain YAML values only") from None
        except (ValueError, TypeError, AttributeError, OverflowError, LookupError):
            # PyYAML's constructors raise these for `!!int abc`, `!!float abc`, `2001-02-30`,
            # `!!timestamp garbage`, `!!bool maybe`, an integer past Python's digit limit, ...
            kind = node.tag.rsplit(":", 1)[-1]
            raise self.fail(node, path, f"{node.value[:40]!r} is not a valid {kind}; write the "
                            "value out plainly (quote it to keep it as text)") from None
        if isinstance(value, str) and not node.style and node.tag == _STR and _EXP_FLOAT.fullmatch(value):
            value = float(value)  # YAML 1.2 reads plain `1e-5` as a number; PyYAML (1.1) as text
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT:
            raise self.fail(node, path, f"integer out of range (at most {MAX_INT:,} in magnitude)")
        if isinstance(value, float) and not math.isfinite(value):
            raise self.fail(node, path, f"{node.value!r} is not a finite number")
        return value


#: libyaml's parser when PyYAML has it (about 10x faster: a registry of 2,000 packages loads
#: 2,000 bundle.yaml files; libyaml bounds nesting at 1,000 levels itself), else PyYAML's own.
_COMPOSER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
DEEP = "nested too deeply (a bundle spec nests about 5 levels)"


def load_yaml(text: str, file: str = "<spec>") -> tuple[object, dict[Path, tuple[int, int]]]:
    try:
        root = yaml.compose(text, Loader=_COMPOSER)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        problem = f"{e.problem or e.context}"
        if "maximum nesting depth" in problem:  # libyaml's bound
            problem = DEEP
        last = text.count("\n") + 1  # libyaml marks an error at the end past the last line
        line, col = (mark.line + 1, mark.column + 1) if mark else (None, None)
        if line is not None and line > last:
            line, col = last, len(text.rsplit("\n", 1)[-1]) + 1
        d = Diagnostic(problem, "", file, line, col)
        raise InvalidInput(f"{file}: not valid YAML", [d]) from None
    except yaml.YAMLError as e:  # pragma: no cover - composer errors are all marked
        raise InvalidInput(f"{file}: not valid YAML: {e}") from None
    except RecursionError:  # PyYAML's parser recurses once per nesting level
        raise InvalidInput(f"{file}: not valid YAML", [Diagnostic(
            DEEP, "", file, 1, 1)]) from None
    if root is None:
        return None, {}
    w = _Walker(file)
    data = w.walk(root, ())
    return data, w.positions
