"""The package's small files: the generated adapter (rendered from ``templates/adapter.py.j2`` and
checked against a whitelist of statement kinds, :func:`check_adapter_source`, here and again when
a package is verified or its adapter loaded), the model card, ``vllm_metadata.json``,
``config.json`` and the resolved ``bundle.yaml``. Templates write values only through filters
that escape them for their place (:func:`pyrepr`, :func:`md`, ...)."""

from __future__ import annotations

import ast
import json
import math
import re

from ..errors import InvalidInput, TTBundleError
from ..fsutil import TEMPLATE_DIR
from .names import RUNTIME_CLASS, PackageError, identifier, tt_arch
from .. import reference
from .names import DRAFT_DIR


class _Checked(str):
    """Template output that went through a filter; the environment refuses anything else."""


def pyrepr(value) -> _Checked:
    """A Python literal for plain data (str, int, finite float, bool, None, list, dict with str
    keys) that ``ast.literal_eval`` reads back as ``value``; anything else is refused."""
    def ok(v):
        if v is None or isinstance(v, (bool, int, str)):
            return True
        if isinstance(v, float):
            return math.isfinite(v)
        if isinstance(v, (list, tuple)):
            return all(ok(x) for x in v)
        if isinstance(v, dict):
            return all(isinstance(k, str) and ok(x) for k, x in v.items())
        return False
    if not ok(value):
        raise InvalidInput(f"cannot write {type(value).__name__} {value!r} into generated code")
    text = repr(value)
    if ast.literal_eval(text) != value:  # pragma: no cover - repr of plain data round-trips
        raise InvalidInput(f"value {value!r} does not round-trip as a Python literal")
    return _Checked(text)


def ident_filter(value) -> _Checked:
    return _Checked(identifier(value, "name"))


def dotted_filter(value) -> _Checked:
    """A dotted module path whose every part is an identifier."""
    for part in str(value).split("."):
        identifier(part, f"module path {value!r}: part")
    return _Checked(value)


def md(value) -> _Checked:
    """Markdown-safe inline text: HTML and markdown control characters escaped, one line."""
    text = " ".join(str(value).split())
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    text = re.sub(r"([\\`*_{}\[\]()#+!|~])", r"\\\1", text)
    return _Checked(text)


def code(value) -> _Checked:
    """Text for an inline code span (no backticks, one line)."""
    return _Checked(" ".join(str(value).replace("`", "'").replace("|", "\\|").split()))


def size(n) -> _Checked:
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return _Checked(f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.2f} {unit}")
        n /= 1024
    raise AssertionError  # pragma: no cover


def jsonstr(value) -> _Checked:
    """A JSON (hence YAML) scalar, for the model card's front matter."""
    return _Checked(json.dumps(value, ensure_ascii=True))


def _env():
    import jinja2

    def finalize(v):
        if isinstance(v, _Checked):
            return v
        raise InvalidInput(f"template bug: {v!r} written without a filter (pyrepr, ident, md, json, num)")

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATE_DIR)), autoescape=False,
                             undefined=jinja2.StrictUndefined, finalize=finalize,
                             keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True)
    env.filters.update(pyrepr=pyrepr, ident=ident_filter, dotted=dotted_filter, md=md, json=jsonstr,
                       code=code, size=size, num=lambda v: _Checked(f"{int(v):,}"))
    return env


def _render(template: str, **ctx) -> str:
    import jinja2
    try:
        return _env().get_template(template).render(**ctx)
    except jinja2.TemplateNotFound:
        raise TTBundleError(f"template {template} not found in {TEMPLATE_DIR} (ttbundle build needs "
                            "the templates/ folder of a source checkout)") from None


def render_adapter(bundle_name: str, mesh_name: str, arch: str, class_name: str, version: str) -> str:
    """The adapter module: imports the runtime's BundleModel and subclasses it with the package
    directory (found from ``__file__`` at import) and the arch baked in. The rendered text is
    parsed and checked against a whitelist of statement kinds before it is returned."""
    src = _render("adapter.py.j2", bundle=bundle_name, mesh=mesh_name, arch=arch, tt_arch=tt_arch(arch),
                  class_name=identifier(class_name, "adapter class name"),
                  runtime_module=RUNTIME_CLASS[0], runtime_class=RUNTIME_CLASS[1], version=version)
    check_adapter_source(src, class_name)
    return src


def check_adapter_source(src: str, class_name: str, where: str | None = None) -> None:
    """Refuse generated adapter code that is anything but: docstring, imports of ``os`` and the
    runtime class, assignments of literals (or ``os.path`` of ``__file__``), and one class whose
    body assigns literals. A template or escaping bug cannot smuggle code past this. ``where``:
    the adapter file of a package (its verification: :func:`verify_package`), which names it in
    a PackageError; else a TTBundleError (``render_adapter``, a template bug)."""
    if where is not None:
        try:
            return check_adapter_source(src, class_name)
        except TTBundleError as e:
            raise PackageError(f"{where}: {e.message}; not the adapter `ttbundle build` writes (rebuild "
                               "the package)") from None
    try:
        tree = ast.parse(src)
    except (SyntaxError, ValueError) as e:
        raise TTBundleError(f"generated adapter does not parse: {e}") from None

    def literal_or_path(node) -> bool:
        try:
            ast.literal_eval(node)
            return True
        except ValueError:
            pass
        dump = ast.dump(node)
        return dump == ast.dump(ast.parse("os.path.dirname(os.path.abspath(__file__))", mode="eval").body)

    def bad(what):
        raise TTBundleError(f"generated adapter rejected: unexpected {what}")

    classes = 0
    for node in tree.body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            continue
        if isinstance(node, ast.ImportFrom) and (node.module, [a.name for a in node.names]) in (
                ("__future__", ["annotations"]), (RUNTIME_CLASS[0], [RUNTIME_CLASS[1]])):
            continue
        if isinstance(node, ast.Import) and [a.name for a in node.names] == ["os"]:
            continue
        if isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) for t in node.targets) \
                and literal_or_path(node.value):
            continue
        if isinstance(node, ast.ClassDef) and node.name == class_name and classes == 0 \
                and [ast.dump(b) for b in node.bases] == [ast.dump(ast.Name(RUNTIME_CLASS[1], ast.Load()))] \
                and not node.decorator_list and not node.keywords:
            classes += 1
            for b in node.body:
                if isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant):
                    continue
                if isinstance(b, ast.Assign) and all(isinstance(t, ast.Name) for t in b.targets) and (
                        literal_or_path(b.value) or (isinstance(b.value, ast.Name) and b.value.id.isupper())):
                    continue
                bad(f"statement in class {class_name}: {ast.dump(b)[:80]}")
            continue
        bad(f"top-level statement: {ast.dump(node)[:80]}")
    if classes != 1:
        bad(f"class layout (want one class {class_name})")


def render_readme(ctx: dict) -> str:
    return _render("README.md.j2", **ctx)


def metadata_json(arch: str, main_class: str) -> str:
    return json.dumps({"arch": arch, "main_class": main_class}, indent=2) + "\n"


def hf_config_json(bundle) -> str:
    """config.json: the arch's HF config (transformers' full dict) with the TT-prefixed arch."""
    cfg = json.loads(reference.hf_config(bundle).to_json_string(use_diff=False))
    cfg["architectures"] = [tt_arch(bundle.family.hf_architecture(bundle.arch))]
    cfg["torch_dtype"] = "bfloat16"
    return json.dumps(cfg, indent=2, sort_keys=True) + "\n"


def resolved_spec(bundle, plan) -> dict:
    """The spec as this package was built: the arch inline (``from_hf`` resolved), the buckets,
    the full resolved sharding plan and per-tensor dtypes, this mesh as the only target, no paths
    (the package holds the weights and tokenizer)."""
    s = bundle.spec
    d = s.model_dump(mode="json", exclude_none=False)
    d["model"] = bundle.arch.model_dump(mode="json")  # nulls kept: some are required keys (q_lora_rank)
    d["from_hf"] = None
    d["tokenizer"] = False if s.tokenizer is False else None  # false: token ids only (serve says so)
    d["targets"] = [plan.mesh.name]
    d["weights"] = {"source": None, "dtypes": {"default": s.weights.dtypes.default,
                                               "tensors": {t.name: t.dtype for t in plan.tensors
                                                           if t.layout == "TILE"}}}
    if s.weights.adapters:  # merged into the weights; where from, for `check PACKAGE`'s reference
        d["weights"]["adapters"] = [str(bundle.resolve_path(p).absolute()) for p in s.weights.adapters]
    d["sharding"] = {k: v for k, v in d["sharding"].items() if k != "targets"}
    d.pop("replicas", None)
    if plan.mesh.target_shape:  # this target's split only
        d["replicas"] = {plan.mesh.name: {"submesh": list(plan.mesh.shape), "count": plan.mesh.replicas}}
    d["sharding"]["plan"] = {n: [_entry(e) for e in sp] for n, sp in plan.specs.items()}
    d["buckets"] = bundle.buckets.model_dump(mode="json")
    # the image settings as they apply (the family's defaults filled in), every field written: a
    # default left out would be filled in again on load, by a rule that may read other fields
    d["vision"] = None if bundle.vision is None else bundle.vision.model_dump(mode="json")
    if d.get("speculative") and d["speculative"].get("method") == "draft":  # the draft's package, inside this one
        d["speculative"]["model"] = f"{DRAFT_DIR}/bundle.yaml"
    return {k: v for k, v in d.items() if v is not None}


def _entry(e):
    if e is None or isinstance(e, str):
        return e
    return list(e)


def render_bundle_yaml(resolved: dict, version: str) -> str:
    import yaml
    head = (f"# Resolved bundle spec written by ttbundle {version}: the arch, sharding plan and "
            "dtypes this package was built with.\n")
    return head + yaml.safe_dump(resolved, sort_keys=False, default_flow_style=None, width=100)
