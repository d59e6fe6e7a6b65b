"""The package format: one directory per bundle and mesh that a serving host loads as is.

Layout (``OUT/<mesh>/<bundle>/``, so ``EXTRA_MODELS_DIR=OUT/<mesh>`` registers every bundle built
for that mesh, see docs/build.md)::

    vllm_metadata.json        {"arch": "<HF arch>", "main_class": "<module>:<class>"} (TT plugin)
    <module>.py               generated adapter: subclasses ttbundle.runtime.adapter.BundleModel
    config.json               HF config, architectures = ["TT<HF arch>"]
    tokenizer.json, ...       tokenizer files copied from the spec's tokenizer directory
    bundle.yaml               the resolved spec for this mesh (loads with `ttbundle validate`)
    weights/device-NNN.safetensors   one file per device, that device's shards in plan order
    programs/<phase>-<bucket>.json   lowered per-device programs (``lower.lower``)
    README.md                 model card with the plan summary
    manifest.json             versions, spec hash, mesh, buckets, content key, sha256 of every file

Weights files are plain safetensors: bf16 shards as ``BF16``; block floats (bfp8/bfp4) as ``U8``
bytes in Tenstorrent's tile format (``ttbundle.blockfloat``). Each tensor is ``<name>`` (global)
or ``<name>.<layer>``; the header's ``__metadata__["ttbundle"]`` says which device the file is,
and each tensor's global shape, PartitionSpec, encoding and ``stored_in``: per device, the device
whose file stores its shard. A shard several devices hold is stored once, by the first of them
(``layout.holders``); format 1 packages (no ``stored_in``: every file holds every shard) still
read.

Its modules, each imported by name (this ``__init__`` imports none of them):

- ``names``: format versions, ``PackageError``, the directory, adapter module, weight file and
  tensor names every other module uses;
- ``templates``: the small files (the adapter, checked against a whitelist, the model card,
  ``vllm_metadata.json``, ``config.json``, the resolved ``bundle.yaml``);
- ``shardfile``: a weights file streamed front to back with its header computed up front;
- ``verify``: whether a package may be used (``verify_package``, one verdict) and its adapter
  imported by path (``load_adapter``);
- ``shards``: reading the weights back (``PackageWeights``, shards several devices share);
- ``load``: a package read back (``load_package`` -> ``LoadedPackage``), programs and headers
  checked against each other.
"""
