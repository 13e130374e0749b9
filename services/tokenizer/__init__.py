"""The tokenizer service (the frontend): client connections, chat templates, tokenization,
incremental detokenization and stop strings. Run it with `python -m services.tokenizer`."""
