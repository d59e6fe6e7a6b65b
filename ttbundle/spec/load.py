"""Loading a spec: YAML with line numbers -> :class:`Bundle`, or ``InvalidInput`` carrying every
problem found, each located as ``file:line:col: key.path: message``."""

from __future__ import annotations

from pathlib import Path

from pydantic import ValidationError

from .. import families
from ..errors import Diagnostic, InvalidInput
from ..yamlpos import load_yaml
from .bundle import Bundle, InvalidSpec, locate
from .checks import check
from .hf import import_hf
from .messages import loc_path, pydantic_message
from .schema import BundleSpec
from .. import hub
from ..fsutil import read_user_text


def load(path: str | Path) -> Bundle:
    path = Path(path)
    return loads(read_user_text(path, "spec file"), str(path), base_dir=path.parent)


def loads(text: str, file: str = "<spec>", base_dir: Path | None = None) -> Bundle:
    data, positions = load_yaml(text, file)
    if not isinstance(data, dict):
        raise InvalidInput(f"{file}: invalid spec", [Diagnostic(
            "a bundle spec is a YAML mapping (name:, model: or from_hf:, targets:, ...)", "", file, 1, 1)])
    base_dir = base_dir or Path(".")
    diags: list[Diagnostic] = []
    hf_arch = None
    if "from_hf" in data and "model" not in data and isinstance(data["from_hf"], str):
        try:
            hf_arch = import_hf(hub.resolve(data["from_hf"], base_dir).path)
        except InvalidInput as e:
            diags.append(locate(file, positions, ("from_hf",), e.message))
    try:
        spec = BundleSpec.model_validate(data)
    except ValidationError as e:
        seen = set()
        for err in e.errors():
            path = loc_path(err["loc"], data)
            if err["type"] == "union_tag_invalid":
                path += ("family",)
            if isinstance(err.get("input"), list) and any(
                    isinstance(p, str) and p.startswith("literal['rows'") for p in err["loc"]):
                continue  # a list entry: its items' errors say what is wrong
            if path in seen:  # a union reports one error per member; the first says it
                continue
            seen.add(path)
            diags.append(locate(file, positions, path, pydantic_message(err, data)))
        raise InvalidInput(f"{file}: invalid spec", diags) from None
    if diags:
        raise InvalidInput(f"{file}: invalid spec", diags)

    if (spec.model is None) == (spec.from_hf is None):
        raise InvalidInput(f"{file}: invalid spec", [locate(
            file, positions, ("model",) if spec.model else (),
            "give exactly one of `model:` (family and dims) or `from_hf:` (a directory with config.json)")])
    if spec.model is not None:
        arch = spec.model
    else:
        try:
            arch = families.get(hf_arch["family"]).arch_model.model_validate(hf_arch)
        except ValidationError as e:
            raise InvalidInput(f"{file}: invalid spec", [locate(
                file, positions, ("from_hf",),
                f"config.json: {'.'.join(map(str, err['loc']))}: {pydantic_message(err)}")
                for err in e.errors()]) from None
    bundle = Bundle(spec, arch, families.get(arch.family), file, base_dir, positions)
    diags = check(bundle, load)
    errors = [d for d in diags if d.severity == "error"]
    bundle.warnings = [d for d in diags if d.severity == "warning"]
    if errors:
        raise InvalidSpec(f"{file}: invalid spec", diags, bundle)
    return bundle
