"""skillcache: precompiled, composable and editable KV caches for skills, served over HTTP."""

__version__ = "0.1.0"
