"""The DeepSpeed boundary: the JSON dsopt writes, DeepSpeed's own parser to validate it, the ZeRO buffer sizes
both the builder and the ledger use, and the one DeepSpeed release the ledger follows."""
