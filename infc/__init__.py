"""infc: an inference compiler for large language models."""
