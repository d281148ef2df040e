"""Speculative decoding: proposers of draft tokens that the target model verifies in one step."""
