"""Code generation: render each launch's kernel template, then compile it ahead of time.

The contract between a template and everything else is its META dict (see
docs/kernels.md): entry name, parameters with where each value comes from, constexprs,
grid formula, warps and stages. The plan carries META; the runtime needs nothing more.
"""
