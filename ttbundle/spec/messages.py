"""pydantic's validation errors in a spec's words: the message for one error, the key path in
the document it points at, a hint for a misspelt key."""

from __future__ import annotations

import difflib
import typing
from typing import Annotated, Union

from pydantic import BaseModel

from .. import families
from .schema import BundleSpec


def pydantic_message(err: dict, data=None) -> str:
    t, msg = err["type"], err["msg"]
    if t == "extra_forbidden":
        return "unknown key; " + _key_hint(err["loc"], data)
    if t == "union_tag_invalid":
        return (f"unknown family {err.get('ctx', {}).get('tag', err.get('input'))!r}; supported: "
                f"{', '.join(families.all_families())}")
    if t == "value_error" and "error" in err.get("ctx", {}):
        return str(err["ctx"]["error"])
    if any(isinstance(p, str) and p.startswith(("literal['rows'", "list[literal['rows'"))
           for p in err["loc"]):
        return ("a PartitionSpec entry is null, an axis name (rows, cols) or a list of axis names, "
                f"got {_get(data, loc_path(err['loc'], data))!r}")
    if t == "union_tag_not_found":
        return f"missing `family`; one of: {', '.join(families.all_families())}"
    if t == "literal_error":
        return f"{msg}, got {err.get('input')!r}"
    if t == "missing":
        return "required key is missing"
    if t in _TYPE_ERRORS and "input" in err:  # strict types: say what was given and what to write
        got = err["input"]
        hint = ""
        if isinstance(got, bool) and t != "bool_type":
            hint = " (true/false is not a number)"
        elif isinstance(got, str) and t in ("int_type", "float_type"):
            hint = " (write the number without quotes)"
        elif t == "bool_type":
            hint = " (write true or false)"
        return f"{msg}, got {got!r}{hint}"
    return msg


#: pydantic's type errors of strict mode: the message says what was given
_TYPE_ERRORS = ("int_type", "float_type", "bool_type", "string_type", "list_type", "tuple_type",
                "dict_type")


def _get(data, path: tuple):
    for p in path:
        try:
            data = data[p]
        except (KeyError, IndexError, TypeError):
            return None
    return data


def _fields_at(loc: tuple, data) -> list[str]:
    """Field names of the model that holds the key at ``loc`` (pydantic's loc), or []."""
    model = BundleSpec
    path = loc_path(loc, data)[:-1]
    for i, seg in enumerate(path):
        f = model.model_fields.get(seg) if isinstance(seg, str) else None
        if f is None:
            return []
        todo, cands = [f.annotation], []
        while todo:
            t = todo.pop()
            if isinstance(t, type) and issubclass(t, BaseModel):
                cands.append(t)
            elif typing.get_origin(t) in (Union, Annotated) or type(t).__name__ == "UnionType":
                todo += list(typing.get_args(t))
        if len(cands) > 1:  # the family union: pick by the `family` tag
            fam = _get(data, path[:i + 1] + ("family",))
            cands = [c for c in cands if "family" in c.model_fields
                     and c.model_fields["family"].default == fam]
        if len(cands) != 1:
            return []
        model = cands[0]
    return list(model.model_fields)


def _key_hint(loc: tuple, data) -> str:
    key, fields = loc[-1], _fields_at(loc, data)
    close = difflib.get_close_matches(str(key), fields, n=1, cutoff=0.6)
    if close:
        return f"did you mean `{close[0]}`?"
    if fields:
        return f"keys here: {', '.join(fields)}"
    return "check the spelling (`ttbundle schema` lists every key)"


def loc_path(loc: tuple, data) -> tuple:
    """pydantic's ``loc`` as a path in ``data``: pydantic also puts the discriminator tag (e.g.
    "llama") and union member names ("literal['rows','cols']") into loc; those are not keys of
    the document (a user key may well contain "[")."""
    out, node = [], data
    for i, p in enumerate(loc):
        if isinstance(node, dict) and p in node:
            node = node[p]
        elif (isinstance(node, list) and isinstance(p, int) and not isinstance(p, bool)
              and 0 <= p < len(node)):
            node = node[p]
        elif isinstance(node, dict) and i == len(loc) - 1:
            node = None  # a required key that is missing
        else:
            continue  # a union member tag
        out.append(p)
    return tuple(out)
