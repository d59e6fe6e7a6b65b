"""Check ttnn calls against the installed wheel's own signatures (no device needed).

ttnn's functions are nanobind objects: each exposes ``__nb_signature__``, one
``("def name(params) -> ret", doc, defaults)`` per overload, with parameter names, kinds
(positional, ``*`` keyword-only, ``/`` positional-only), defaults and type annotations as text;
operations wrap them (``ttnn.matmul.function``, whose ``__call__`` has the signature); a few
entry points are plain Python functions (``inspect.signature``). :func:`check` binds a
:class:`~.calls.Call`'s arguments to every overload the way Python would and checks each value's
kind against the annotation (a tensor where ``Tensor`` is named, a bool where ``bool`` is, an
enum member whose type is named, a constructed config object of a class the annotation names, a
``None`` only where ``None`` is allowed). ``New`` arguments are constructed for real (config
objects are host objects) and ``Attr`` ones resolved, so a misspelled enum member fails too.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass

from .calls import KV, Attr, Call, New, T, W, resolve_attr


@dataclass(frozen=True)
class Param:
    name: str
    annotation: str
    has_default: bool
    positional: bool  # may be passed positionally
    keyword: bool  # may be passed by name


def _split_top(s: str) -> list[str]:
    out, depth, cur, quote = [], 0, [], False
    for ch in s:
        if ch == '"':
            quote = not quote
        elif not quote and ch in "([{":
            depth += 1
        elif not quote and ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0 and not quote:
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        out.append("".join(cur).strip())
    return out


def parse_nb(sig: str) -> list[Param]:
    """Parameters of one nanobind signature line ``def f(a: int, *, b: X | None = \\0) -> R``."""
    start = sig.index("(")
    depth, end = 0, None
    for i in range(start, len(sig)):
        if sig[i] == "(":
            depth += 1
        elif sig[i] == ")":
            depth -= 1
            if depth == 0:
                end = i
                break
    parts = _split_top(sig[start + 1:end])
    params, kw_only = [], False
    raw = []
    for p in parts:
        p = p.replace("\\*", "*").strip()
        if p in ("self",):
            continue
        if p == "*":
            kw_only = True
            continue
        if p == "/":  # everything before is positional-only
            raw = [(n, a, d, True, False) for n, a, d, _, _ in raw]
            continue
        name, _, rest = p.partition(":")
        ann, eq, _default = rest.partition(" = ")
        if not rest:  # "name=default" without annotation
            name, eq, _default = p.partition("=")
        raw.append((name.strip().lstrip("*"), ann.strip(), bool(eq), not kw_only, True))
    return [Param(*r) for r in raw]


def overloads(obj) -> list[list[Param]]:
    """Every overload's parameters of a ttnn callable (function, operation, or class)."""
    if isinstance(obj, type):
        sigs = getattr(obj.__init__, "__nb_signature__", None)
        if sigs:
            return [parse_nb(s[0]) for s in sigs]
        return [_from_inspect(inspect.signature(obj))]
    fn = getattr(obj, "function", obj)  # ttnn operations wrap the registered C++ op (or a Python one)
    sigs = getattr(fn, "__nb_signature__", None) or getattr(type(fn).__call__, "__nb_signature__", None)
    if sigs:
        return [parse_nb(s[0]) for s in sigs]
    return [_from_inspect(inspect.signature(fn))]


def _from_inspect(sig: inspect.Signature) -> list[Param]:
    out = []
    for p in sig.parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.annotation is p.empty:
            ann = "Any"
        elif isinstance(p.annotation, str):
            ann = p.annotation
        else:  # a class by name; typing constructs (Union[str, Path]) spelled out
            ann = p.annotation.__name__ if isinstance(p.annotation, type) else str(p.annotation)
        out.append(Param(p.name, ann, p.default is not p.empty,
                         p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD),
                         p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)))
    return out


# ---- value kinds ----------------------------------------------------------------------------------
class Opaque:
    """A runtime object the checker knows only by its ttnn type name (``MeshDevice``,
    ``MeshTraceId``, ``Tensor``): what the recording double hands out."""

    def __init__(self, type_name: str):
        self.type_name = type_name

    def __repr__(self):
        return f"<{self.type_name}>"


def _words(ann: str) -> set[str]:
    """The identifiers in an annotation (``ttnn._ttnn.tensor.Tensor | None`` -> Tensor, None, ...),
    so ``Tensor`` does not match ``ComplexTensor``."""
    return set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", ann))


def _accepts(ttnn, ann: str, v) -> tuple[bool, str]:
    """Whether a parameter annotated ``ann`` accepts value ``v``; a reason when not."""
    if ann in ("", "Any", "object"):
        return True, ""
    words = _words(ann)
    return _accepts_words(ttnn, words, v)


def _accepts_words(ttnn, ann: set, v) -> tuple[bool, str]:
    if v is None:
        return bool({"None", "Optional"} & ann), "None not allowed"
    if isinstance(v, (T, W, KV)):
        return "Tensor" in ann, "a tensor"
    if isinstance(v, Opaque):
        return v.type_name in ann, v.type_name
    if isinstance(v, bool):
        return "bool" in ann, "a bool"
    if isinstance(v, int):
        return bool({"int", "float"} & ann), "an int"
    if isinstance(v, float):
        return "float" in ann, "a float"
    if isinstance(v, str):
        return "str" in ann, "a str"
    if isinstance(v, (list, tuple)):
        if not {"Sequence", "list", "tuple", "Shape", "Set"} & ann:
            return False, "a sequence"
        if all(isinstance(x, (T, W, KV)) for x in v):
            return "Tensor" in ann, "a sequence of tensors"
        if all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            return bool({"int", "Shape"} & ann), "a sequence of ints"
        return True, ""
    if isinstance(v, Attr):
        obj = resolve_attr(ttnn, v.path)
        tname = type(obj).__name__
        return tname in ann, f"{v.path} ({tname})"
    if isinstance(v, New):
        return v.type_name in ann, f"a {v.type_name}"
    return False, f"an unexpected {type(v).__name__}"


def bind(ttnn, params: list[Param], args: tuple, kwargs: dict) -> str | None:
    """None if ``args`` / ``kwargs`` bind to ``params`` with acceptable kinds, else why not."""
    pos = [p for p in params if p.positional]
    if len(args) > len(pos):
        return f"{len(args)} positional arguments, at most {len(pos)}"
    given = {}
    for p, v in zip(pos, args):
        given[p.name] = v
    names = {p.name: p for p in params}
    for k, v in kwargs.items():
        p = names.get(k)
        if p is None or not p.keyword:
            return f"no keyword argument {k!r}"
        if k in given:
            return f"{k!r} given twice"
        given[k] = v
    for p in params:
        if p.name not in given and not p.has_default:
            return f"missing {p.name!r}"
    for k, v in given.items():
        ok, what = _accepts(ttnn, names[k].annotation, v)
        if not ok:
            return f"{k}: {what} where {names[k].annotation!r}"
    return None


def construct(ttnn, v: New):
    """Build a ``New`` for real (its nested ``New`` / ``Attr`` arguments too)."""
    def real(x):
        if isinstance(x, New):
            return construct(ttnn, x)
        if isinstance(x, Attr):
            return resolve_attr(ttnn, x.path)
        return x
    cls = resolve_attr(ttnn, v.cls)
    return cls(*[real(a) for a in v.args], **{k: real(x) for k, x in v.kwargs})


def check(ttnn, fn: str, args: tuple = (), kwargs: dict | None = None) -> list[str]:
    """Problems with calling ``ttnn.<fn>(*args, **kwargs)`` (empty: it binds)."""
    kwargs = dict(kwargs or {})
    try:
        obj = resolve_attr(ttnn, fn)
    except AttributeError:
        return [f"ttnn.{fn} does not exist in ttnn {getattr(ttnn, '__version__', '')}".strip()]
    problems = []
    for v in list(args) + list(kwargs.values()):
        for x in _flatten(v):
            if isinstance(x, Attr):
                try:
                    resolve_attr(ttnn, x.path)
                except AttributeError:
                    problems.append(f"ttnn.{x.path} does not exist")
            elif isinstance(x, New):
                try:
                    made = construct(ttnn, x)
                except Exception as e:  # noqa: BLE001 - any refusal is the finding
                    problems.append(f"ttnn.{x.cls}(...) refused: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
                    continue
                if x.returns and type(made).__name__ != x.returns:
                    problems.append(f"ttnn.{x.cls}(...) returned a {type(made).__name__}, not a {x.returns}")
    if problems:
        return problems
    reasons = []
    for params in overloads(obj):
        why = bind(ttnn, params, tuple(args), kwargs)
        if why is None:
            return []
        reasons.append(why)
    return [f"ttnn.{fn}: no overload accepts the arguments ({'; '.join(reasons)})"]


def _flatten(v):
    yield v
    if isinstance(v, New):
        for x in list(v.args) + [x for _, x in v.kwargs]:
            yield from _flatten(x)
    elif isinstance(v, (list, tuple)):
        for x in v:
            yield from _flatten(x)


def check_call(ttnn, call: Call) -> list[str]:
    return check(ttnn, call.fn, call.args, dict(call.kwargs))
