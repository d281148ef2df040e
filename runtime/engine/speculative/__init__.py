"""Speculative decoding: proposers and the exact verification of their drafts (issue 43)."""
