"""test_server_disconnect's clients that leave mid-request, on the tiny random models of the
families whose engines hold more than KV pages (test_server_support.MODELS): Qwen3.5's per-sequence
state slots and DeepSeek-V2's latent pages must all be free after each wave of aborts (assert_clean
checks the slots too). test_server.py runs the openai SDK suite itself on these models."""
from test_server_disconnect import (test_50_streaming_clients_disconnect_mid_stream,  # noqa: F401
                                    test_non_streaming_clients_disconnect)
from test_server_support import DEFAULT, MODELS, one_blas_thread, per_model_srv  # noqa: F401

srv = per_model_srv([m for m in MODELS if m != DEFAULT])
