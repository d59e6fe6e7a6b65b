"""ttbundle: declarative model bundles for serving LLMs with vLLM on Tenstorrent meshes."""

__version__ = "0.1.0"
