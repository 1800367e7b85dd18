"""The embedded default: tiny models and tokenizer built here, the toy tasks, their warm start."""
