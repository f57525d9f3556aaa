"""What the server serves and how it is doing: ``/health``, ``/metrics``, ``/v1/models``, ``/tokenize``,
``/detokenize``, ``/tokenizer_info``."""
