"""Speculative decoding: proposers of draft tokens and the exact verification of those drafts
by the target model in one step (issue 43)."""
