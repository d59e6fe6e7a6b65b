"""The launchers: what builds a package when asked and starts vLLM on it, apart from the vLLM
plugin (``ttbundle.runtime``) that runs inside vLLM.

``serve`` (``ttbundle serve``: vLLM's OpenAI server on a package, a spec built first),
``launch`` (``serve --print-launch``: the commands a multi-host or multi-replica target takes)
and ``demo`` (demo and test packages: a word-level tokenizer, random-weight packages). They may
import the build; the plugin may not (the ``plugin-not-build`` contract in pyproject.toml).
"""
