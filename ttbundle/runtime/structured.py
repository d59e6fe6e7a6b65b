"""A structured-output request whose JSON schema no value can satisfy is refused with a 400 before
it reaches vLLM's grammar backend.

A ``$ref`` loop with nothing else to match (``{"$ref": "#"}``, or ``a -> b -> a`` through
``$defs``) compiles, in xgrammar, to a rule that only derives itself (``root ::= root``): a grammar
that accepts no string. vLLM 0.33 validates the schema without noticing (``Grammar.from_json_schema``
succeeds), the bitmask then allows no token, the sampled token is rejected and the scheduler ends
the request as an internal error: HTTP 500. :func:`ref_loop` finds such a loop at the schema's
root;
:func:`hook_schema_check` makes vLLM's request validation (``SamplingParams.verify``, in the API
server, where a ``VLLMValidationError`` is a 400) call it first. Only a root no value can
satisfy is refused: a loop below a property or an item, or beside other keywords, is left to the
backend, which answers those requests (it generates around the dead branch).
"""

from __future__ import annotations

import json
from urllib.parse import unquote

#: keywords that constrain nothing (annotations and the places definitions live)
_INERT = frozenset({"$ref", "$defs", "definitions", "title", "description", "$comment", "$id", "$schema",
                    "$anchor", "examples", "default", "deprecated", "readOnly", "writeOnly"})
_HOOKED = "_ttbundle_checks_ref_loops"


def _resolve(root, ref: str):
    """The node a local ``$ref`` (``#`` or ``#/json/pointer``) names in ``root``, or None."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        return None  # remote or $id-relative: not ours to follow
    node = root
    pointer = unquote(ref[1:])
    if pointer == "":
        return node
    if not pointer.startswith("/"):
        return None  # an $anchor name
    for part in pointer[1:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _pure_ref(node) -> str | None:
    """The ``$ref`` of a node that constrains nothing else, or None."""
    if isinstance(node, dict) and isinstance(node.get("$ref"), str) and set(node) <= _INERT:
        return node["$ref"]
    return None


def ref_loop(schema) -> str | None:
    """Why no JSON value satisfies ``schema`` (a dict or its JSON text): the schema itself, through
    references alone (and ``anyOf``/``oneOf`` whose every branch, ``allOf`` one of whose parts, is
    such a reference), comes back to itself with nothing else to match; None otherwise (or when
    it is not JSON: vLLM says so itself). A loop below a property or an item is not refused:
    vLLM's backend generates around it (the request is answered, as it was)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            return None
    loop = _loops(schema, schema, [], 0)
    if loop is None:
        return None
    return (f"the JSON schema's $ref {' -> '.join(repr(r) for r in loop)} is a loop of references "
            "with nothing else to match: no JSON value satisfies it, so no output could be generated; "
            "give the recursion a base case (an `anyOf` with a schema that does not refer back)")


def _loops(root, node, path: list, depth: int) -> list | None:
    """The references of a loop that ``node`` (reached from the root through ``path``, the
    references followed, and the nodes on it) cannot escape, or None."""
    if depth > 64 or not isinstance(node, dict):
        return None
    on_path = [n for _, n in path]
    if any(n is node for n in on_path):
        return [r for r, _ in path]
    keys = set(node) - _INERT
    ref = node.get("$ref")
    if isinstance(ref, str) and keys <= {"allOf"}:
        target = _resolve(root, ref)
        if target is not None:
            found = _loops(root, target, path + [(ref, node)], depth + 1)
            if found:
                return found
    if keys == {"allOf"} and isinstance(node["allOf"], list):  # one part that cannot be met: none
        for part in node["allOf"]:
            found = _loops(root, part, path + [("allOf", node)], depth + 1)
            if found:
                return [r for r in found if r != "allOf"]
    for kw in ("anyOf", "oneOf"):  # every branch that cannot be met: none
        if keys == {kw} and isinstance(node[kw], list) and node[kw]:
            found = [_loops(root, b, path + [(kw, node)], depth + 1) for b in node[kw]]
            if all(found):
                return [r for r in found[0] if r not in ("anyOf", "oneOf", "allOf")]
    return None


def hook_schema_check() -> None:
    """Make ``SamplingParams`` validation refuse a JSON schema :func:`ref_loop` finds a loop in,
    with vLLM's own request error (HTTP 400 naming it). Idempotent."""
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import SamplingParams

    validate = SamplingParams._validate_structured_outputs
    if getattr(validate, _HOOKED, False):
        return

    def _validate_structured_outputs(self, model_config, structured_outputs_config, tokenizer):
        so = self.structured_outputs
        if structured_outputs_config is not None and so is not None and so.json is not None:
            why = ref_loop(so.json)
            if why:
                raise VLLMValidationError(why, parameter="response_format")
        return validate(self, model_config, structured_outputs_config, tokenizer)

    setattr(_validate_structured_outputs, _HOOKED, True)
    SamplingParams._validate_structured_outputs = _validate_structured_outputs
