"""The bundle spec: a typed model of the YAML file, loading with line numbers, semantic checks.

``load(path)`` returns a :class:`Bundle` (the validated spec, the family and its arch dims, and
a locator for every key), or raises :class:`InvalidInput` carrying *all* problems found, each
located as ``file:line:col: key.path: message``.

Split along its seams: ``schema`` (the pydantic model of the file), ``bundle`` (a loaded spec,
``locate``), ``messages`` (pydantic's errors in the spec's words), ``hf`` (``from_hf:``'s
config.json), ``checks`` (the mesh-independent rules), ``load``. The names below are the
package's public ones (``specmod.load``, ``specmod.Sharding``, ...).
"""

from __future__ import annotations

from .bundle import Bundle, InvalidSpec, locate
from .checks import check
from .hf import HF_MAX_INT, HF_OBJECT_KEYS, hf_config_to_arch
from .load import load, loads
from .messages import pydantic_message
from .schema import (DECODE_TRACE_SIZES, DEFAULT_QUALITY, NAME_RE, AxisName, Buckets, BundleSpec, DtypePolicy,
                     DType, Embedding, PartitionEntry, PartitionSpec, Quality, QualityTarget, Replicas, Runtime,
                     Sharding, Speculative, Vision, Weights, json_schema)

__all__ = ["DECODE_TRACE_SIZES", "DEFAULT_QUALITY", "Quality", "QualityTarget", "HF_MAX_INT", "HF_OBJECT_KEYS", "NAME_RE", "AxisName", "Buckets", "Bundle",
           "BundleSpec", "DType", "DtypePolicy", "Embedding", "InvalidSpec", "PartitionEntry", "PartitionSpec",
           "Replicas", "Runtime", "Sharding", "Speculative", "Vision", "Weights", "check", "hf_config_to_arch",
           "json_schema", "load", "loads", "locate", "pydantic_message"]
