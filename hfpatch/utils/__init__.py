"""Small utilities that depend on nothing else of hfpatch: one-line command errors and exit codes (command), locks,
content hashes and folders written whole (files), free host memory (host), side-by-side timing (timing), warnings
that point at the caller's line (warn), a model in eval mode for a while (modes).
"""
